"""Python halves of the compiled ops: fake (meta) implementations for
``torch.compile`` and the autograd formula.

The schema and the CPU/CUDA kernels are registered in C++ (``TORCH_LIBRARY_FRAGMENT(ftshims)``
in csrc/rotary.cpp). Here:

* ``ftshims::rotary`` (out of place) gets a fake impl returning ``empty_like``
  outputs (exactly what the C++ op allocates) and an autograd formula: the
  rotation is orthogonal (times ``scaling``), so the gradient is the conjugate
  rotation of the incoming gradient, computed by the same op with
  ``conjugate`` flipped. cos/sin/inv_freq get no gradient (the public API
  routes calls that need one to the reference backend).
* ``ftshims::rotary_`` (in place) gets a fake impl; its autograd is handled by
  :class:`InplaceRotary` in the public API.
"""

from __future__ import annotations

import threading

_DONE = False
_LOCK = threading.Lock()


def _fake_rotary(q, k, cos, sin, inv_freq, positions, seqlen_offsets, cu_seqlens, offset, rotary_dim, interleaved, conjugate, scaling):
    import torch

    outs = [torch.empty_like(q)]
    if k is not None:
        outs.append(torch.empty_like(k))
    return outs


def _fake_rotary_(q, k, cos, sin, inv_freq, positions, seqlen_offsets, cu_seqlens, offset, rotary_dim, interleaved, conjugate, scaling):
    return None


def _setup_context(ctx, inputs, output):
    q, k, cos, sin, inv_freq, positions, seqlen_offsets, cu_seqlens, offset, rotary_dim, interleaved, conjugate, scaling = inputs
    ctx.has_k = k is not None
    ctx.save_for_backward(cos, sin, inv_freq, positions, seqlen_offsets, cu_seqlens)
    ctx.args = (offset, rotary_dim, interleaved, conjugate, scaling)


def _backward(ctx, grads):
    import torch

    cos, sin, inv_freq, positions, seqlen_offsets, cu_seqlens = ctx.saved_tensors
    offset, rotary_dim, interleaved, conjugate, scaling = ctx.args
    grad_q = grads[0]
    grad_k = grads[1] if ctx.has_k else None
    outs = torch.ops.ftshims.rotary(
        grad_q, grad_k, cos, sin, inv_freq, positions, seqlen_offsets, cu_seqlens,
        offset, rotary_dim, interleaved, not conjugate, scaling,
    )
    dq = outs[0]
    dk = outs[1] if ctx.has_k else None
    return (dq, dk) + (None,) * 11


def register_python_parts() -> None:
    """Register the fake impls and the autograd formula once per process."""
    global _DONE
    with _LOCK:
        if _DONE:
            return
        import torch

        torch.library.register_fake("ftshims::rotary")(_fake_rotary)
        torch.library.register_fake("ftshims::rotary_")(_fake_rotary_)
        torch.library.register_autograd("ftshims::rotary", _backward, setup_context=_setup_context)
        global INPLACE_FUNCTION
        INPLACE_FUNCTION = make_inplace_function()  # built eagerly: torch.compile cannot trace a class definition
        _DONE = True


INPLACE_FUNCTION = None


def make_inplace_function():
    """An autograd.Function around the in-place op (built lazily: torch is imported here)."""
    import torch

    class InplaceRotary(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *inputs):  # the op's 13 arguments, in its order
            torch.ops.ftshims.rotary_(*inputs)
            _setup_context(ctx, inputs, None)  # the same saved state as the out-of-place op's autograd
            q, k = inputs[:2]
            if k is not None:
                ctx.mark_dirty(q, k)
                return q, k
            ctx.mark_dirty(q)
            return q

        @staticmethod
        def backward(ctx, *grads):
            return _backward(ctx, grads)  # the same conjugate rotation as the out-of-place op

    return InplaceRotary
