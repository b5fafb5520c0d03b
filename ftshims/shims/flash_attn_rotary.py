"""flash-attn rotary: rows past the cos/sin table, bf16 cos/sin in ``RotaryEmbedding``, ``pos_idx_in_fp32`` on 2.8.

Why (each reproduced on the released 2.5.8, 2.6.3 and 2.8.3 files, run with
Triton's interpreter; line numbers are those files'):

* a **tensor** ``seqlen_offsets`` that reaches past the cos/sin table leaves
  those rows *silently unrotated*: the kernel's masked table loads return
  cos=1, sin=0 (``ops/triton/rotary.py`` 2.5.8/2.6.3 l.69-74 and l.108-117,
  2.8.3 l.72-74). An int offset is asserted (2.5.8/2.6.3 l.185, 2.8.3 l.147),
  a tensor never is. ``RotaryEmbedding.forward`` hits this whenever a tensor
  ``seqlen_offset`` comes without a ``max_seqlen`` covering it: it only grows
  its table for an int offset or an explicit ``max_seqlen``
  (``layers/rotary.py`` 2.5.8/2.6.3 l.432-435, 2.8.3 l.450-453), e.g. decoding
  with per-sequence offsets after a shorter prefill;
* ``RotaryEmbedding`` caches cos/sin in the input dtype (``.to(dtype)``,
  2.5.8/2.6.3 l.400-412, 2.8.3 l.415-427): bf16 q/k are rotated by
  bf16-rounded cos/sin, several bf16 ulps off at large positions
  (flash-attn#823). 2.5.8-2.7.4 moreover assert ``x.dtype == cos.dtype``
  (2.5.8/2.6.3 l.175-177), so an fp32 table cannot simply be handed over;
  2.8 dropped that assert and its kernel loads cos/sin ``.to(tl.float32)``
  whatever their dtype (2.8.3 l.73-74);
* flash-attn 2.8 removed ``RotaryEmbedding(pos_idx_in_fp32=...)``
  (2.5.8/2.6.3 l.323), which transformers 4.48-4.52 ModernBERT passes
  (``pos_idx_in_fp32=True``): ``TypeError`` (transformers#38700, #38912).

What the shim does, and nothing else (flash-attn's own Triton kernel does all
the rotating; nothing is compiled or built):

* ``flash_attn.ops.triton.rotary.apply_rotary`` (and every module-level copy,
  e.g. ``flash_attn.layers.rotary``'s and ModernBERT's) is wrapped: a tensor
  ``seqlen_offsets`` is checked against the table (one device-to-host read of
  ``max(offsets + lengths)``) and a ``ValueError`` replaces the unrotated
  rows. Here the table is the caller's (it may be scaled, NTK-stretched or
  arbitrary), so no row past it can be made up: an error is the only correct
  answer, as upstream's own assert for an int offset says. On versions that
  assert equal dtypes, a bf16/fp16 ``x`` with an fp32 table is upcast to fp32
  around the released kernel and cast back once: exactly what 2.8's kernel
  does internally (fp32 arithmetic, one rounding at the store). Every other
  call reaches the released function with the caller's arguments unchanged:
  bit-identical results.
* ``RotaryEmbedding.forward`` with a tensor ``seqlen_offset``: the module owns
  its table's recipe, so when ``max(seqlen_offset) + seqlen`` reaches past it
  the table is grown to that length first (the rule flash-attn applies to an
  int offset) and the rows are rotated correctly.
* ``RotaryEmbedding._update_cos_sin_cache`` builds its tables in fp32 (its
  ``dtype`` argument is replaced by ``float32``); the core wrapper above makes
  2.5.8-2.7.4 accept them.
* on versions without the parameter (2.8), ``RotaryEmbedding.__init__``
  accepts the keyword ``pos_idx_in_fp32=True``, which is what 2.8 always does;
  ``False`` (legacy low-precision positions, which 2.8 cannot compute) still
  raises ``TypeError``, now saying why.

Under ``torch.compile`` both offset steps stand aside (each reads
``max(offsets)`` on the host, which would break the graph, and an error
``fullgraph=True`` cannot trace): compiled code gets flash-attn's released
behaviour there; the fp32 tables and the upcast are tensor-only and stay.

Applies to flash-attn >= 2.2 (the first sdist with the Triton rotary file),
< 2.9; unfixed upstream as of 2.8.3. Falls back: if ``apply_rotary`` is
missing or its parameters changed, the shim is skipped (target missing); if
``RotaryEmbedding`` or one of its methods changed shape, that part is skipped
with a note and the core guard stays. Routing the rotary API to ftshims' own
kernel is the opt-in speed shim ``flash_attn_rotary_kernel``.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import sys
import types

from .._util import acted, compiling, module_globals
from ..spec import Observation, ProbeUnsupported, ShimSpec, Target, TargetMissing

CORE_PARAMS = ("x", "cos", "sin", "seqlen_offsets", "cu_seqlens", "max_seqlen", "interleaved", "inplace", "conjugate")
FORWARD_PARAMS = ("qkv", "kv", "seqlen_offset", "max_seqlen")
CACHE_PARAMS = ("seqlen", "device", "dtype")

SPEC = ShimSpec(
    id="flash_attn_rotary",
    since="0.1.0",
    unpinned="flash-attn cannot be installed without CUDA, so no pinned stack has it: its released rotary files "
    "(2.5.8, 2.6.3, 2.8.3) run under Triton's CPU interpreter in the rotary_flash session instead (nox -s rotary_flash)",
    title="flash-attn rotary: silent unrotated rows past the table, bf16 cos/sin, pos_idx_in_fp32 TypeError",
    symptom="tensor seqlen_offsets past the cos table leave rows unrotated; bf16 cos/sin; RotaryEmbedding(pos_idx_in_fp32=...) TypeError on 2.8",
    why="flash-attn's rotary leaves rows past the cos/sin table unrotated when seqlen_offsets is a tensor, caches cos/sin in bf16, and 2.8 removed RotaryEmbedding(pos_idx_in_fp32=...), which ModernBERT passes. The shim grows RotaryEmbedding's table, raises for a caller's too-short table, keeps cos/sin in fp32 and accepts pos_idx_in_fp32=True.",
    stand_in="flash-attn's released Triton rotary code under Triton's CPU interpreter",
    requires={"flash-attn": ">=2.2,<2.9"},
    fixed_in={},
    refs=(
        "https://github.com/Dao-AILab/flash-attention/issues/823",
        "https://github.com/huggingface/transformers/pull/38700",
        "https://github.com/huggingface/transformers/pull/38912",
        "https://github.com/EleutherAI/gpt-neox/pull/1003",
    ),
    targets=(
        Target("flash_attn.ops.triton.rotary", "apply_rotary", params=CORE_PARAMS),
        Target("flash_attn.layers.rotary", "RotaryEmbedding.forward", params=FORWARD_PARAMS),
        Target("flash_attn.layers.rotary", "RotaryEmbedding._update_cos_sin_cache", params=CACHE_PARAMS),
        Target("flash_attn.layers.rotary", "RotaryEmbedding.__init__", when=">=2.8"),
    ),
    modules=("flash_attn.ops.triton.rotary",),
)

log = logging.getLogger("ftshims")


def _arg(args, kwargs, index, name, default):
    """Argument ``name`` (positional ``index``) of a call, or its released default."""
    return args[index] if len(args) > index else kwargs.get(name, default)


def require_positional_order(func, names, where):
    """TargetMissing unless ``func``'s first parameters are ``names`` in that order (the wrappers read them by position)."""
    try:
        params = list(inspect.signature(func).parameters)
    except (TypeError, ValueError) as exc:
        raise TargetMissing(f"{where}: no signature ({exc})") from exc
    if params[: len(names)] != list(names):
        raise TargetMissing(f"{where}: parameters are ({', '.join(params)}), expected ({', '.join(names)}, ...)")


def wrap_copies(patcher, original, wrapper, installed):
    """Wrap every module-level name that calls ``original``: the function itself, or another shim's wrapper of it.

    ``from flash_attn.ops.triton.rotary import apply_rotary`` copies the function
    into ``flash_attn.layers.rotary``, into transformers' ModernBERT and into
    user code. A copy taken after this shim wrapped the definition is already
    this shim's wrapper (``installed`` holds their ids) and is left alone.
    """
    count = 0
    for module, attr, value in module_globals():
        kind = type(value)  # never isinstance(): it falls back to value.__class__, which some module globals warn on
        if id(value) in installed or kind is not types.FunctionType and not hasattr(kind, "__wrapped__"):
            continue
        try:
            reaches = value is original or inspect.unwrap(value) is original
        except Exception:  # an object whose __wrapped__ misbehaves is not ours to patch
            continue
        if reaches:
            installed.add(id(patcher.wrap(module, attr, wrapper)))
            count += 1
    return count


# ---------------------------------------------------------------------------
# the core: checked tensor offsets, fp32 tables on versions that assert equal dtypes


def _asserts_same_dtype(func) -> bool:
    """Whether this flash-attn's ``apply_rotary`` asserts ``x.dtype == cos.dtype`` (2.2-2.7; 2.8 does not)."""
    try:
        return "x.dtype == cos.dtype" in inspect.getsource(func)
    except (OSError, TypeError):
        return True  # unknown: upcasting around it is correct either way


def check_offsets(x, cos, seqlen_offsets, cu_seqlens):
    """ValueError when a tensor ``seqlen_offsets`` sends rows past the ``cos``/``sin`` table.

    Only well-formed calls are checked (the released asserts report the rest):
    the rows a sequence touches are ``offset .. offset + length - 1``, with
    ``length`` from ``cu_seqlens`` (varlen) or ``x.shape[1]``.
    """
    import torch

    if not isinstance(seqlen_offsets, torch.Tensor) or seqlen_offsets.dim() != 1 or seqlen_offsets.numel() == 0:
        return
    if seqlen_offsets.dtype not in (torch.int32, torch.int64) or not isinstance(cos, torch.Tensor) or cos.dim() != 2:
        return
    if cu_seqlens is None:
        if x.dim() != 4 or seqlen_offsets.shape[0] != x.shape[0]:
            return
        end = int(seqlen_offsets.max()) + x.shape[1]
    else:
        if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] != seqlen_offsets.shape[0] + 1:
            return
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int64)
        end = int((seqlen_offsets.to(torch.int64) + lengths).max())
    rows = cos.shape[0]
    if end > rows:
        raise ValueError(
            f"flash_attn rotary: seqlen_offsets reach position {end - 1}, outside the cos/sin table ({rows} rows); "
            "flash-attn would return those rows unrotated. Pass a table covering max(seqlen_offsets) + seqlen "
            "(RotaryEmbedding: max_seqlen)"
        )


def make_core_wrapper(original, upcast: bool):
    """The wrapper of ``apply_rotary``: offsets checked; on ``upcast`` versions, fp32 tables accepted for bf16/fp16 x."""
    signature = inspect.signature(original)

    def wrapper(wrapped, instance, args, kwargs):
        import torch

        x = _arg(args, kwargs, 0, "x", None)
        cos = _arg(args, kwargs, 1, "cos", None)
        if not compiling():  # the check reads max(offsets) on the host: a graph break inside a trace
            check_offsets(x, cos, _arg(args, kwargs, 3, "seqlen_offsets", 0), _arg(args, kwargs, 4, "cu_seqlens", None))
        if not (
            upcast
            and isinstance(x, torch.Tensor)
            and isinstance(cos, torch.Tensor)
            and cos.dtype == torch.float32
            and x.dtype in (torch.bfloat16, torch.float16)
        ):
            return wrapped(*args, **kwargs)
        acted(SPEC.id, "bf16/fp16 rotations upcast around the equal-dtype assert")
        # The released code would assert here. Run it on an fp32 copy of x, in place (the copy is
        # ours), and round once: the arithmetic of 2.8's kernel, which loads bf16 x as fp32.
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        inplace = bool(bound.arguments["inplace"])
        with torch.no_grad():
            x32 = x.float()
            bound.arguments["x"] = x32
            bound.arguments["inplace"] = True
            wrapped(*bound.args, **bound.kwargs)
            if inplace:
                return x.copy_(x32)
            return x32.to(x.dtype)

    return wrapper


# ---------------------------------------------------------------------------
# RotaryEmbedding: grown table for tensor offsets, fp32 table, pos_idx_in_fp32


def _grow_for_tensor_offsets(wrapped, instance, args, kwargs):
    import torch

    qkv = _arg(args, kwargs, 0, "qkv", None)
    offset = _arg(args, kwargs, 2, "seqlen_offset", 0)
    if compiling():  # growing reads max(offset) on the host: a graph break inside a trace
        return wrapped(*args, **kwargs)
    if instance is not None and isinstance(qkv, torch.Tensor) and isinstance(offset, torch.Tensor) and offset.numel():
        max_seqlen = _arg(args, kwargs, 3, "max_seqlen", None)
        if max_seqlen is not None:
            # What the released forward does first; it repeats it as a no-op.
            instance._update_cos_sin_cache(max_seqlen, device=qkv.device, dtype=qkv.dtype)
        end = int(offset.max()) + qkv.shape[1]
        table = instance._cos_cached
        if table is None or table.shape[0] < end:
            instance._update_cos_sin_cache(end, device=qkv.device, dtype=qkv.dtype)
            acted(SPEC.id, "cos/sin tables grown for tensor offsets")
    return wrapped(*args, **kwargs)


def _fp32_cache(wrapped, instance, args, kwargs):
    import torch

    bound = dict(zip(CACHE_PARAMS, args))
    bound.update(kwargs)
    bound["dtype"] = torch.float32
    return wrapped(**bound)


def _accept_pos_idx_in_fp32(wrapped, instance, args, kwargs):
    if "pos_idx_in_fp32" in kwargs:
        if not kwargs.pop("pos_idx_in_fp32"):
            raise TypeError(
                "RotaryEmbedding(pos_idx_in_fp32=False): this flash-attn (>= 2.8) always computes positions in fp32 "
                "and cannot reproduce the legacy low-precision positions; use flash-attn < 2.8 for such a model"
            )
    wrapped(*args, **kwargs)
    if instance is not None:
        instance.pos_idx_in_fp32 = True  # the attribute 2.2-2.7 set


def install(patcher, options) -> None:
    from ..patching import require_params, resolve

    ops = sys.modules["flash_attn.ops.triton.rotary"]
    owner, attr = resolve(ops, "apply_rotary")
    original = inspect.unwrap(getattr(owner, attr))
    require_params(original, CORE_PARAMS, "flash_attn.ops.triton.rotary.apply_rotary")
    require_positional_order(original, CORE_PARAMS, "flash_attn.ops.triton.rotary.apply_rotary")
    upcast = _asserts_same_dtype(original)
    wrapper = make_core_wrapper(original, upcast)
    installed = set()
    wrap_copies(patcher, original, wrapper, installed)
    if upcast:
        patcher.notes.append("apply_rotary asserts equal dtypes here: bf16/fp16 x with fp32 cos/sin runs upcast to fp32")

    def layers_part(layers):
        wrap_copies(patcher, original, wrapper, installed)  # layers' own copy, if taken before the ops module was patched
        cls = vars(layers).get("RotaryEmbedding")
        if not isinstance(cls, type):
            raise TargetMissing("flash_attn.layers.rotary.RotaryEmbedding not found")
        for name, params, wrapper_ in (
            ("_update_cos_sin_cache", CACHE_PARAMS, _fp32_cache),
            ("forward", FORWARD_PARAMS, _grow_for_tensor_offsets),
        ):
            method = vars(cls).get(name)
            if method is None:
                raise TargetMissing(f"flash_attn.layers.rotary.RotaryEmbedding.{name} not found")
            where = f"RotaryEmbedding.{name}"
            require_params(method, params, where)
            require_positional_order(method, ("self",) + params, where)
        patcher.wrap(cls, "_update_cos_sin_cache", _fp32_cache)
        patcher.wrap(cls, "forward", _grow_for_tensor_offsets)
        if "pos_idx_in_fp32" not in inspect.signature(cls.__init__).parameters:
            patcher.wrap(cls, "__init__", _accept_pos_idx_in_fp32)

    # flash_attn.layers.rotary imports the ops module at its top: when that import is what
    # triggered this install, the layers module is still executing (its classes do not exist yet).
    patcher.when_imported("flash_attn.layers.rotary", layers_part)


# ---------------------------------------------------------------------------
# probe


@contextlib.contextmanager
def cpu_triton():
    """flash-attn launches inside ``torch.cuda.device(x.device.index)``, which fails for CPU tensors
    (index None); under Triton's interpreter on CPU that context must be a no-op."""
    import torch

    original = torch.cuda.device
    torch.cuda.device = lambda index: contextlib.nullcontext() if index is None else original(index)
    try:
        yield
    finally:
        torch.cuda.device = original


def _device():
    import os

    import torch

    if torch.cuda.is_available():
        return "cuda"
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise ProbeUnsupported("flash-attn's Triton kernels need a GPU or TRITON_INTERPRET=1")
    return "cpu"


def reference_rotary(x, cos, sin, interleaved=False):
    """fp64 rotation of ``x[..., seq, heads, dim]`` by per-position ``cos``/``sin`` (``[seq, rd/2]`` or ``[batch, seq, rd/2]``)."""
    import torch

    x, cos, sin = x.double(), cos.double().unsqueeze(-2), sin.double().unsqueeze(-2)
    half = cos.shape[-1]
    rot, rest = x[..., : 2 * half], x[..., 2 * half :]
    x0, x1 = (rot[..., 0::2], rot[..., 1::2]) if interleaved else (rot[..., :half], rot[..., half:])
    o0, o1 = x0 * cos - x1 * sin, x0 * sin + x1 * cos
    out = torch.stack((o0, o1), -1).flatten(-2) if interleaved else torch.cat((o0, o1), -1)
    return torch.cat((out, rest), -1)


def fp64_table(positions, dim, base=10000.0):
    """cos/sin ``[len(positions), dim/2]`` in fp64 for RotaryEmbedding's default frequencies."""
    import torch

    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    phase = positions.double()[..., None] * inv
    return phase.cos(), phase.sin()


def ulp_errors(out, ref, x):
    """max |out - ref| in bf16 ulps of max(|ref|, |x| / 16) (a floor against cancellation near zero)."""
    import torch

    floor = x.double().abs().amax(dim=-1, keepdim=True) / 16
    mag = torch.maximum(ref.abs(), floor)
    ulp = torch.pow(2.0, torch.floor(torch.log2(mag)) - 7)
    return ((out.double() - ref).abs() / ulp).max().item()


def probe(case: str = "offset_past_table") -> Observation:
    """Reproductions on the installed flash-attn's own rotary code (no ftshims kernel involved).

    ``offset_past_table``: ``apply_rotary_emb`` with the caller's table and a
    tensor ``seqlen_offsets`` reaching past it must raise, not return
    unrotated rows (guarded). ``offset_past_cache``: ``RotaryEmbedding``
    decoding with tensor offsets past its prefill-sized table must rotate
    every row as the fp64 reference does (fixed). ``bf16_table``:
    ``RotaryEmbedding`` on bf16 qkv at positions ~4000 must be as accurate as
    fp32 cos/sin allow: within 1.25 bf16 ulp of the fp64 result (fp32 cos/sin
    cost ~0.05 ulp; the final rounding 0.5 ulp on GPUs, which round to
    nearest, and < 1 ulp under Triton's CPU interpreter, which truncates its
    fp32 -> bf16 stores; bf16 cos/sin cost ~2.5 ulp and more).
    ``pos_idx_in_fp32``: ``RotaryEmbedding(..., pos_idx_in_fp32=True)`` must
    construct. ``parity``: ``apply_rotary_emb`` on valid input matches the
    fp64 reference (healthy everywhere).
    """
    import torch

    device = _device()
    ctx = cpu_triton() if device == "cpu" else contextlib.nullcontext()
    from flash_attn.layers import rotary as fa  # noqa: F401  (imports flash_attn.ops.triton.rotary)

    gen = torch.Generator().manual_seed(0)
    with ctx:
        if case == "offset_past_table":
            x = torch.randn(2, 4, 2, 16, generator=gen).to(device)
            cos, sin = (t.float().to(device) for t in fp64_table(torch.arange(6), 16))
            offsets = torch.tensor([0, 5], dtype=torch.int32, device=device)  # row 1 needs positions 5..8 of 6
            try:
                out = fa.apply_rotary_emb(x, cos, sin, seqlen_offsets=offsets)
            except (ValueError, AssertionError) as exc:
                return Observation(False, f"rejected: {type(exc).__name__}: {exc}")
            unrotated = int((out[1] == x[1]).flatten(1).all(dim=-1).sum())
            return Observation(True, f"no error; {unrotated} of the 3 rows past the table returned unrotated")
        if case == "offset_past_cache":
            dim = 16
            emb = fa.RotaryEmbedding(dim, device=device)
            emb(torch.randn(2, 4, 3, 2, dim, generator=gen).to(device))  # prefill: a 4-row table
            qkv = torch.randn(2, 3, 3, 2, dim, generator=gen).to(device)
            x = qkv.clone()
            offsets = torch.tensor([1, 5], dtype=torch.int32, device=device)  # decode: positions 1..3 and 5..7
            try:
                out = emb(qkv, seqlen_offset=offsets)
            except Exception as exc:
                return Observation(True, f"{type(exc).__name__}: {exc}")
            pos = offsets.cpu().long()[:, None] + torch.arange(3)
            cos, sin = fp64_table(pos, dim)
            ref = reference_rotary(x[:, :, :2].cpu(), cos[:, :, None], sin[:, :, None])
            got = out[:, :, :2].double().cpu()
            err = (got - ref).abs().max().item()
            unrotated = int((got == x[:, :, :2].double().cpu()).flatten(2).all(dim=-1).sum())  # (batch, seq) rows
            detail = f"{unrotated} of 6 decoded rows unrotated, max |error| {err:.2e} vs fp64 (table {tuple(emb._cos_cached.shape)})"
            return Observation(err > 1e-5, detail)
        if case == "pos_idx_in_fp32":
            try:
                emb = fa.RotaryEmbedding(16, pos_idx_in_fp32=True, device=device)
            except TypeError as exc:
                return Observation(True, f"TypeError: {exc}")
            return Observation(False, f"constructed {type(emb).__name__}(pos_idx_in_fp32=True)")
        if case == "bf16_table":
            dim, start, seqlen = 64, 4000, 8
            emb = fa.RotaryEmbedding(dim, base=10000.0, device=device)
            qkv = torch.randn(2, seqlen, 3, 2, dim, generator=gen).to(device=device, dtype=torch.bfloat16)
            x = qkv.clone()
            out = emb(qkv, seqlen_offset=start)
            cos, sin = fp64_table(torch.arange(start, start + seqlen), dim)
            qk = x[:, :, :2].cpu()
            ref = reference_rotary(qk, cos[:, None], sin[:, None])
            err = ulp_errors(out[:, :, :2].cpu(), ref, qk)
            table = getattr(emb, "_cos_cached", None)
            detail = f"max error {err:.2f} bf16 ulp (cos/sin cache {getattr(table, 'dtype', None)})"
            return Observation(err > 1.25, detail)
        if case == "parity":
            x = torch.randn(2, 6, 3, 32, generator=gen).to(device)
            cos, sin = (t.float().to(device) for t in fp64_table(torch.arange(16), 24))
            out = fa.apply_rotary_emb(x, cos, sin, seqlen_offsets=3)
            ref = reference_rotary(x.cpu(), cos[3:9].cpu(), sin[3:9].cpu())
            err = (out.double().cpu() - ref).abs().max().item()
            return Observation(err > 1e-5, f"max |error| {err:.2e} vs fp64")
    raise ValueError(f"unknown case {case!r}")
