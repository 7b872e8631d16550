#!/usr/bin/env python3
"""Checks the SASS of the decode kernels (nvdisasm -c output) and prints a Markdown table.

    sass-check.py ARCH FILE.sass      prints table rows; exit 1 if a check fails

For every tensor-core `paged_prefill_attention_*` entry point (all but f32): HMMA
instructions exist. The one-warp kernels (no `_d<head_dim>` suffix) read fragments with
LDSM (ldmatrix) and stage K/V with LDGSTS (an f16/bf16 cache) or, for an fp8 cache
(`*_e4m3`, `*_e5m2`), with 16-byte loads (LDG.128) decoded in registers. The multi-warp
kernels (`*_d64`, `*_d128`) stage every cache type with LDGSTS (and no 16-byte plain global
loads: q is read as scalars) and wait with DEPBAR, and
read 16-bit caches with LDSM (fp8 is decoded from shared memory by plain loads).

For every fp8 entry point on sm_90: the conversions are the hardware's (an F2FP
instruction on E4M3/E5M2 operands), not the software path.

For every `paged_decode_attention*` entry point:
  * K and V are staged with cp.async: LDGSTS (16-byte, L1-bypassing) instructions exist;
  * the only 16-byte global loads (LDG.*.128) are the query's, at most two per thread
    (one per 16-byte chunk of q it holds), so no K/V byte is read with a plain load;
  * the pipeline waits (DEPBAR) and the dot products and accumulators fuse (FFMA).
"""
import re
import sys

HEADER = re.compile(r"^//-+ \.text\.(\S+)\s+-+$", re.M)
OP = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)((?:\.[A-Z0-9_]+)*)")
MAX_Q_LOADS = 2
DECODE_KERNELS = 28  # (3 types + 2 x 2 fp8 pairs) x (runtime geometry, d64, d128, d256)
PREFILL_KERNELS = 24  # (f16, bf16 + 2 x 2 fp8 pairs) x (one-warp, one-warp tree, d64, d128)


def is_fp8(name):
    return "_e4m3" in name or "_e5m2" in name


def is_tiled(name):
    return re.search(r"_d\d+$", name) is not None


def fp8_verdict(arch, name, ops):
    if arch == "sm_90" and is_fp8(name):
        if not any(o.startswith("F2FP") and ("E4M3" in o or "E5M2" in o) for o in ops):
            return ["no hardware fp8 conversion (F2FP)"]
    return []


def sections(text):
    heads = list(HEADER.finditer(text))
    for i, h in enumerate(heads):
        end = heads[i + 1].start() if i + 1 < len(heads) else len(text)
        body = text[h.end():end]
        # The last kernel's section ends where the symbol table begins.
        body = body.split("//--------------------- SYMBOLS", 1)[0]
        yield h.group(1), body


def main():
    arch, path = sys.argv[1], sys.argv[2]
    text = open(path, encoding="utf-8", errors="replace").read()
    ok, seen = True, 0
    prefill = 0
    for name, body in sections(text):
        ops = [m.group(1) + m.group(2) for m in OP.finditer(body)]
        if name.startswith("paged_prefill_attention_") and not name.endswith("f32"):
            prefill += 1
            hmma = sum(1 for o in ops if o.startswith("HMMA.16816.F32"))
            ldsm = sum(1 for o in ops if o.startswith("LDSM"))
            ldgsts = sum(1 for o in ops if o.startswith("LDGSTS") and ".128" in o)
            ldg128 = sum(1 for o in ops if o.startswith("LDG.") and ".128" in o)
            ffma = sum(1 for o in ops if o.startswith("FFMA"))
            ex2 = sum(1 for o in ops if o == "MUFU.EX2")
            depbar = sum(1 for o in ops if o.startswith("DEPBAR"))
            verdict = []
            if hmma == 0:
                verdict.append("no HMMA")
            if ldsm == 0 and not (is_tiled(name) and is_fp8(name)):
                verdict.append("no LDSM")
            if is_tiled(name):
                if ldgsts == 0:
                    verdict.append("no LDGSTS")
                if ldg128 > 0:
                    verdict.append(f"{ldg128} LDG.128 (K/V through plain loads?)")
                if depbar == 0:
                    verdict.append("no DEPBAR (cp.async wait)")
            elif is_fp8(name):
                if ldg128 == 0:
                    verdict.append("no LDG.128 (fp8 K/V loads)")
            elif ldgsts == 0:
                verdict.append("no LDGSTS")
            verdict += fp8_verdict(arch, name, ops)
            status = f"ok (HMMA {hmma}, LDSM {ldsm})" if not verdict else "FAIL: " + ", ".join(verdict)
            ok = ok and not verdict
            print(f"| {arch} | {name} | {ldgsts} | {ldg128} | {depbar} | {ffma} | {ex2} | {status} |")
            continue
        if not name.startswith("paged_decode_attention"):
            continue
        seen += 1
        ldgsts = sum(1 for o in ops if o.startswith("LDGSTS") and ".128" in o)
        ldg128 = sum(1 for o in ops if o.startswith("LDG.") and ".128" in o)
        ffma = sum(1 for o in ops if o.startswith("FFMA"))
        depbar = sum(1 for o in ops if o.startswith("DEPBAR"))
        ex2 = sum(1 for o in ops if o == "MUFU.EX2")
        verdict = []
        if ldgsts == 0:
            verdict.append("no LDGSTS")
        if ldg128 > MAX_Q_LOADS:
            verdict.append(f"{ldg128} LDG.128 (K/V through plain loads?)")
        if ffma == 0:
            verdict.append("no FFMA")
        if depbar == 0:
            verdict.append("no DEPBAR (cp.async wait)")
        verdict += fp8_verdict(arch, name, ops)
        status = "ok" if not verdict else "FAIL: " + ", ".join(verdict)
        ok = ok and not verdict
        print(f"| {arch} | {name} | {ldgsts} | {ldg128} | {depbar} | {ffma} | {ex2} | {status} |")
    if seen != DECODE_KERNELS:
        print(f"sass-check: {seen} decode kernels in {path}, expected {DECODE_KERNELS}", file=sys.stderr)
        ok = False
    if prefill != PREFILL_KERNELS:
        print(f"sass-check: {prefill} tensor-core prefill kernels in {path}, expected {PREFILL_KERNELS}", file=sys.stderr)
        ok = False
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
