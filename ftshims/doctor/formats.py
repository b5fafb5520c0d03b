"""The report in three forms: text for a terminal, Markdown for a bug report, JSON for tools.

Renderers only read the report dict (docs/doctor-json.md); each section has
one text and one Markdown renderer, and an empty probes, advisories or
findings section renders as nothing.

Size: every report section has a text and a Markdown renderer, kept side by side so that the two forms
of a section change together; each renderer is short.
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, Optional

from ..spec import SPEED
from .shims import NOT_AFFECTED, OPT_IN, PATCHED, PATCHED_ON_IMPORT, UNPATCHED, UNVERIFIED

_VERDICT_TEXT = {
    PATCHED: "patched by ftshims.apply()",
    PATCHED_ON_IMPORT: "patched by ftshims.apply() when its module is imported (targets not checked: --no-import)",
    UNVERIFIED: "could not verify (its module did not import)",
    UNPATCHED: "UNPATCHED: the known bug stays even with ftshims.apply()",
    OPT_IN: "opt-in, not applied by default: ftshims.apply(include=[...])",
    NOT_AFFECTED: "not affected",
}


def to_json(report: Dict[str, Any]) -> str:
    return json.dumps(report, indent=2, default=str) + "\n"


# -- shared pieces ----------------------------------------------------------


def _v(value: Any, missing: str = "-") -> str:
    return missing if value is None or value == "" else str(value)


def _torch_line(torch: Dict[str, Any]) -> str:
    status = torch.get("status")
    if status == "not installed":
        return "not installed"
    if status == "import failed":
        return f"import FAILED: {torch.get('error')}"
    if status != "imported":
        return _v(status, "unknown")
    parts = [_v(torch.get("version"), "?")]
    if torch.get("hip"):
        parts.append(f"ROCm/HIP {torch['hip']}")
    parts.append(f"CUDA {torch['cuda']}" if torch.get("cuda") else "CPU-only build")
    if torch.get("cudnn"):
        parts.append(f"cuDNN {torch['cudnn']}")
    if torch.get("cxx11_abi") is not None:
        parts.append(f"C++11 ABI {'TRUE' if torch['cxx11_abi'] else 'FALSE'}")
    return ", ".join(parts)


def _deepspeed_line(ds: Dict[str, Any]) -> Optional[str]:
    """``0.19.8, accelerator cpu (detected: no CUDA device ...)``; None when DeepSpeed is not installed."""
    if not ds or not ds.get("version"):
        return None
    where = ds.get("source") or "?"
    detail = f": {ds['detail']}" if ds.get("detail") else ""
    return f"{ds['version']}, accelerator {_v(ds.get('accelerator'), 'unknown')} ({where}{detail})"


def _gpu_lines(torch: Dict[str, Any]) -> List[str]:
    if torch.get("status") != "imported":
        return ["unknown (torch did not import)"]
    devices = torch.get("devices") or []
    if not torch.get("cuda_available"):
        extra = "; MPS available" if torch.get("mps_available") else ""
        return [f"none (CUDA not available){extra}"]
    lines = []
    for d in devices:
        mem = f", {d['memory_gib']} GiB" if d.get("memory_gib") else ""
        lines.append(f"[{d['index']}] {_v(d.get('name'), '?')}, capability {_v(d.get('capability'), '?')}{mem}")
    return lines or ["CUDA available but no device listed"]


def _bf16(torch: Dict[str, Any]) -> str:
    if torch.get("status") != "imported":
        return "unknown"
    value = torch.get("bf16_supported")
    if value is None:
        return "n/a (no CUDA device; on CPU torch computes bf16, usually slowly)"
    return "yes" if value else "no (use fp16 or fp32)"


def _pkg_text(row: Dict[str, Any]) -> str:
    if row["status"] == "not installed":
        return "-"
    text = _v(row.get("version"), "?")
    if row["status"] == "broken metadata":
        text = f"BROKEN METADATA ({row.get('detail')})" if row.get("version") is None else f"{text}  BROKEN METADATA ({row.get('detail')})"
    elif row.get("detail"):
        text += f"  ({row['detail']})"
    return text


def _flash_lines(fa: Dict[str, Any]) -> List[str]:
    status = fa.get("status")
    if status == "not installed":
        return ["not installed"]
    head = f"{status}"
    if fa.get("version"):
        head = f"{status} (flash-attn {fa['version']})"
    if status in ("ok", "timeout") and fa.get("seconds") is not None:
        head += f" in {fa['seconds']} s"
    lines = [head]
    if fa.get("ok") is False and fa.get("error"):
        lines.append(f"error: {fa['error']}")
    if fa.get("ok") is False and fa.get("message"):
        lines.append(fa["message"])
    if fa.get("fix"):
        lines.append(f"fix: {fa['fix']}")
    if status == "skipped" and fa.get("message"):
        lines.append(fa["message"])
    return lines


def _timing_text(report: Dict[str, Any]) -> str:
    timing = report["timing"]
    sections = timing.get("sections") or {}
    parts = [f"{name} {sec:.1f} s" for name, sec in sections.items() if sec >= 0.05]
    total = timing.get("total_s")
    total_text = f"{total:.1f} s" if isinstance(total, (int, float)) else "?"
    return f"{total_text}" + (f" ({', '.join(parts)})" if parts else "")


# -- text ---------------------------------------------------------------------


def to_text(report: Dict[str, Any]) -> str:
    out: List[str] = []
    env = report["environment"]
    torch = env.get("torch") or {}
    py = env.get("python") or {}
    plat = env.get("platform") or {}
    ft = report["ftshims"]
    out.append(f"ftshims doctor — ftshims {_v(ft.get('version'), '?')}{_ftshims_env(report)} (report schema {report['schema_version']})")
    out.append("")
    out.append("Environment")
    rows = [
        ("Python", f"{_v(py.get('version'), '?')} ({_v(py.get('implementation'), '?')}) {_v(py.get('executable'), '')}".rstrip()),
        ("Platform", f"{_v(plat.get('platform'), '?')}, {_v(plat.get('cpu_count'), '?')} CPUs"),
        ("torch", _torch_line(torch)),
    ]
    gpus = _gpu_lines(torch)
    rows.append(("GPU", gpus[0]))
    rows += [("", line) for line in gpus[1:]]
    rows.append(("bf16", _bf16(torch)))
    ds_line = _deepspeed_line(env.get("deepspeed") or {})
    if ds_line:
        rows.append(("DeepSpeed", ds_line))
    out += [f"  {k:<10}{v}" for k, v in rows]
    if torch.get("field_errors"):
        out += [f"  {'':<10}(could not read {e})" for e in torch["field_errors"]]

    out.append("")
    out.append("Packages")
    width = max((len(r["name"]) for r in report["packages"]), default=0) + 2
    out += [f"  {r['name']:<{width}}{_pkg_text(r)}" for r in report["packages"]]
    if report.get("tested_stack", {}).get("message"):
        out += ["", "Tested stack (ftshims/data/stacks.toml)", f"  {report['tested_stack']['message']}"]
    out += _frameworks_text(report.get("frameworks") or {})

    out.append("")
    out.append("flash-attn import (in a subprocess)")
    out += [f"  {line}" for line in _flash_lines(report["flash_attn"])]

    out.append("")
    trial = report["trial"]
    out.append(f"Shims (trial: {_v(trial.get('mode'), '?')}; nothing stays patched)")
    if trial.get("fingerprint"):
        out.append(f"  fingerprint {trial['fingerprint']['hash']}: what ftshims.apply() here records with a run "
                   "(ftshims.fingerprint())")
    if not report["shims"]:
        failed = {e["section"] for e in report["errors"]} & {"shims", "trial"}
        out.append("  could not be evaluated (see the doctor errors below)" if failed else "  none registered")
    for s in report["shims"]:
        if not s["affected"]:
            out.append(f"  {s['id']}: not affected ({s['range']}{_fixed(s, '; ')})")
            continue
        # a speed shim fixes no bug: in range, it is available, not a bug this stack has
        headline = "available" if s["kind"] == SPEED else "AFFECTED"
        out.append(f"  {s['id']}: {headline} [{s['kind']}] {s['title']}")
        pad = "      "
        out.append(f"{pad}versions  {s['range']}")
        out.append(f"{pad}symptom   {s['symptom']}")
        out.append(f"{pad}apply()   {s['status']} ({s['reason']})")
        for target in s.get("patched") or []:
            out.append(f"{pad}patches   {target}")
        out.append(f"{pad}verdict   {_VERDICT_TEXT.get(s['verdict'], s['verdict'])}")
        if s.get("evidence"):
            out.append(f"{pad}evidence  {s['evidence']} (what the shim delivers where this bug exists; see COMPAT_MATRIX.md)")
        if s.get("since"):
            out.append(f"{pad}since     ftshims {s['since']} (apply(release=...) pins a release; CHANGELOG.md)")
        if s.get("upstream_report"):
            out.append(f"{pad}upstream  unfixed in every release: reproduction in {s['upstream_report']} (ftshims repository)")
        for note in s.get("notes") or []:
            out.append(f"{pad}note      {note}")
        if s["refs"]:
            out.append(f"{pad}refs      {s['refs'][0]}" + (f" (+{len(s['refs']) - 1} more)" if len(s["refs"]) > 1 else ""))
    failed = [row for row in trial.get("imports") or [] if not row["ok"]]
    for row in failed:
        out.append(f"  import {row['module']} FAILED: {row['error']}")

    out += _findings_text(report)

    summary = report["summary"]
    out.append("")
    out.append("Summary")
    out.append(f"  {summary.get('message', '')}")
    for problem in summary.get("problems", []):
        out.append(f"  PROBLEM  {problem['id']}: {problem['message']}")
    for warning in summary.get("warnings", []):
        out.append(f"  warning  {warning}")
    for error in report["errors"]:
        out.append(f"  doctor error in {error['section']}: {error['error']}")
    out.append(f"  Exit code {summary.get('exit_code')}; took {_timing_text(report)}.")
    return "\n".join(out) + "\n"


def _ftshims_env(report: Dict[str, Any]) -> str:
    env = report["ftshims"].get("env") or {}
    return "".join(f", {name}={value}" for name, value in env.items())


def _fixed(s: Dict[str, Any], sep: str = " ") -> str:
    if not s.get("fixed_in"):
        return ""
    return sep + "fixed in " + ", ".join(f"{k} {v}" for k, v in s["fixed_in"].items())


def _probe_lines(report: Dict[str, Any]) -> List[str]:
    from .probes import bug_present_text, fixed_text

    section = report["probes"]
    out: List[str] = []
    skipped = [r["shim_id"] for r in section["results"] if r.get("status") == "skipped"]
    for r in section["results"]:
        if r.get("status") in ("no probe", "skipped"):
            continue
        out.append(f"  {r.get('shim_id')}: bug present: {bug_present_text(r)}; fixed by the shim: {fixed_text(r)}"
                   + (f" ({r['seconds']:.1f} s)" if isinstance(r.get("seconds"), (int, float)) else ""))
        out.append(f"      {r.get('verdict')}: {r.get('detail', '')}")
        if r.get("output_tail") and r.get("status") in ("crashed", "timeout", "error"):
            out += [f"      | {line}" for line in str(r["output_tail"]).splitlines()[-5:]]
    if skipped:
        out.append(f"  not probed (opt-in speed shims; --probe-all): {', '.join(skipped)}")
    return out


def _probe_heading(report: Dict[str, Any]) -> str:
    section = report["probes"]
    parts = []
    if section.get("seconds") is not None:
        parts.append(f"{section['seconds']:.1f} s")
    if section.get("mode"):
        parts.append(f"{section['mode']} mode, {section.get('jobs')} at a time")
    if section.get("timeout_s"):
        parts.append(f"{section['timeout_s']:g} s limit each")
    return "Probes (each shim's reproduction without and with the shim" + (f"; {', '.join(parts)}" if parts else "") + ")"


def _frameworks_text(section: Dict[str, Any]) -> List[str]:
    """Fine-tuning frameworks and patchers installed, their ordering advisories, and (``--probe``) which
    of ftshims' targets they replace once imported."""
    rows = [r for r in section.get("frameworks") or [] if r.get("version")]
    if not rows:
        return []
    out = ["", "Frameworks and patchers", "  " + ", ".join(f"{r['name']} {r['version']}" for r in rows)]
    for advisory in section.get("advisories") or []:
        out.append(f"  [{advisory['severity']}] {advisory['message']}")
    probe = section.get("probe")
    if probe:
        replaced = probe.get("replaced") or []
        out.append(f"  after import ({probe.get('status')}): " + (
            "; ".join(f"{r['target']} ({r['shim']}) replaced by {r['by']}" for r in replaced) if replaced
            else "none of ftshims' targets replaced"))
    return out


def _findings_text(report: Dict[str, Any]) -> List[str]:
    """Probes, advisories and lint findings; nothing when a section is empty."""
    out: List[str] = []
    if report["probes"]["results"]:
        out += ["", _probe_heading(report)]
        out += _probe_lines(report)
    if report["advisories"]:
        out += ["", "Advisories (known-bad combinations in this stack)"]
        for a in report["advisories"]:
            versions = ", ".join(f"{k} {v}" for k, v in (a.get("matched") or {}).items())
            out.append(f"  [{a.get('severity')}] {a.get('id')}: {a.get('title')}" + (f" ({versions})" if versions else ""))
            condition = _applies_text(a, report)
            if condition:
                out.append(f"      applies  {condition}")
            if a.get("applies") == "no":
                continue
            if a.get("symptom"):
                out.append(f"      symptom  {a['symptom']}")
            if a.get("remedy"):
                out.append(f"      remedy   {a['remedy']}")
            if a.get("refs"):
                out.append(f"      refs     {a['refs'][0]}" + (f" (+{len(a['refs']) - 1} more)" if len(a["refs"]) > 1 else ""))
    if report["findings"]:
        out += ["", "Setup lint findings"]
        for f in report["findings"]:
            where = " ".join(x for x in (f.get("file") or "", f"[{f['key']}]" if f.get("key") else "") if x)
            out.append(f"  {f.get('severity', '').upper():<7} {f.get('rule')}" + (f"  ({where})" if where else ""))
            out.append(f"      {f.get('message')}")
            out.append(f"      fix: {f.get('fix', '')}")
            if f.get("ref"):
                out.append(f"      ref: {f['ref']}")
            if f.get("explain") and f.get("explain") != f.get("ref"):
                out.append(f"      more: {f['explain']}")
    return out


def _applies_text(a: Dict[str, Any], report: Dict[str, Any]) -> str:
    """Whether a model-specific advisory concerns the model; "" for one without a model condition."""
    types = " or ".join(a.get("model_types") or [])
    if a.get("applies") == "conditional":
        return f"only if you train a {types} model (pass --model CONFIG to check)"
    if a.get("applies") == "no":
        return f"no: your model (--model) is not {types}"
    if types:
        return f"yes: your model (--model) is {types}"
    return ""


def _findings_markdown(report: Dict[str, Any]) -> List[str]:
    from .probes import bug_present_text, fixed_text

    out: List[str] = []
    rows = [r for r in report["probes"]["results"] if r.get("status") not in ("no probe", "skipped")]
    if rows:
        out += ["", f"**{_probe_heading(report)}**", ""]
        out += _table(
            ["shim", "bug present", "fixed by the shim", "verdict", "detail"],
            [[f"`{r['shim_id']}`", bug_present_text(r), fixed_text(r), r.get("verdict"), r.get("detail")] for r in rows],
        )
    if report["advisories"]:
        out += ["", "**Advisories**", ""]
        out += _table(
            ["severity", "advisory", "matched", "applies", "remedy", "ref"],
            [
                [a.get("severity"), f"`{a.get('id')}` {a.get('title')}", ", ".join(f"{k} {v}" for k, v in (a.get("matched") or {}).items()),
                 _applies_text(a, report) or "yes", a.get("remedy"), (a.get("refs") or [None])[0]]
                for a in report["advisories"]
            ],
        )
    if report["findings"]:
        out += ["", "**Setup lint findings**", ""]
        out += _table(
            ["severity", "rule", "where", "finding", "fix"],
            [
                [f.get("severity"), f"`{f.get('rule')}`", " ".join(x for x in (f.get("file") or "", f"`{f['key']}`" if f.get("key") else "") if x),
                 f.get("message"), f.get("fix")]
                for f in report["findings"]
            ],
        )
    return out


# -- markdown -----------------------------------------------------------------


def _cell(value: Any) -> str:
    return _v(value).replace("|", "\\|").replace("\n", " ")


def _table(header: List[str], rows: List[List[Any]]) -> List[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return lines


def to_markdown(report: Dict[str, Any]) -> str:
    env = report["environment"]
    torch = env.get("torch") or {}
    py = env.get("python") or {}
    plat = env.get("platform") or {}
    summary = report["summary"]
    out: List[str] = ["### ftshims doctor", ""]
    out.append(f"**{summary.get('message', '')}** (exit code {summary.get('exit_code')})")
    out.append("")
    env_rows = [
        ["Python", f"{_v(py.get('version'))} ({_v(py.get('implementation'))})"],
        ["Platform", _v(plat.get("platform"))],
        ["torch", _torch_line(torch)],
        ["GPU", "; ".join(_gpu_lines(torch))],
        ["bf16", _bf16(torch)],
        ["ftshims", _v(report["ftshims"].get("version")) + _ftshims_env(report)],
    ]
    ds_line = _deepspeed_line(env.get("deepspeed") or {})
    if ds_line:
        env_rows.insert(5, ["DeepSpeed", ds_line])
    out += _table(["", ""], env_rows)
    out += ["", "<details><summary>Packages</summary>", ""]
    out += _table(["package", "version"], [[r["name"], _pkg_text(r)] for r in report["packages"]])
    out += ["", "</details>", ""]
    if report.get("tested_stack", {}).get("message"):
        out += [f"**Tested stack:** {report['tested_stack']['message']}", ""]
    fa = _flash_lines(report["flash_attn"])
    out.append(f"**flash-attn import:** {fa[0]}")
    out += [f"- {line}" for line in fa[1:]]
    out.append("")
    out.append(f"**Shims** (trial: {_v(report['trial'].get('mode'))})")
    out.append("")
    rows = []
    for s in report["shims"]:
        rows.append(
            [
                f"`{s['id']}`",
                s["kind"],
                ("available" if s["kind"] == SPEED else "yes") if s["affected"] else "no",
                s["status"],
                s["verdict"],
                s["range"] if not s["affected"] else s["reason"],
            ]
        )
    out += _table(["shim", "kind", "affected", "apply()", "verdict", "detail"], rows) if rows else ["none registered"]
    out += _findings_markdown(report)
    extra = [f"- problem: `{p['id']}` {p['message']}" for p in summary.get("problems", [])]
    extra += [f"- warning: {w}" for w in summary.get("warnings", [])]
    extra += [f"- doctor error in {e['section']}: {e['error']}" for e in report["errors"]]
    if extra:
        out += [""] + extra
    out += ["", f"<sub>`python -m ftshims.doctor --markdown`, {_timing_text(report)}</sub>"]
    return "\n".join(out) + "\n"


def render(report: Dict[str, Any], fmt: str) -> str:
    if fmt == "json":
        return to_json(report)
    if fmt == "markdown":
        return to_markdown(report)
    return to_text(report)


__all__ = ["render", "to_json", "to_markdown", "to_text"]
