#!/usr/bin/env python3
"""The steady-state loop of each decode kernel, read from its SASS (nvdisasm -c output).

    decode-model.py ARCH FILE.sass      prints one `key=value` line per loop found
    decode-model.py --anchor NAME ARCH FILE.sass
                                        the same for the one kernel of an anchor's file
                                        (ptx/anchors/), named NAME

For every `paged_decode_attention_*` and `paged_decode_reduce_*` entry point, and every
multi-warp prefill kernel (`paged_prefill_attention_*_d<N>`, whose stage loop is
modelled as a tensor-core decode's), this builds
the control-flow graph of the SASS (basic blocks, branch targets), its dominator tree
and natural loops, and reports:

* decode: each *stage loop* (the innermost loop holding the cp.async copies, LDGSTS, a
  barrier and a wait) and the *tile loop* inside it if there is one (the loop with the
  online-softmax exponentials), with per-iteration counts. The tile size of a CUDA-core
  loop is read from the tile's MUFU.EX2 count (N scores + 1 rescale factor). `examples/decode_model.rs`
  picks the loop a shape runs and turns the counts into the bounds of ptx/resources.md.
* reduce: its partition loop, and the chains of the code before and after it.

Counting rules (a static model, not a trace):
* issued warp-instructions per iteration = the instructions on the longest path
  through one iteration of the loop (header to a back edge, forward edges only):
  predicated-off instructions count as issued, NOPs count, and at a branch the larger
  side is taken. That bounds what a warp issues when its branches are warp-uniform (a
  divergent warp issues both sides); `stage_all_instr` counts every block of the loop
  for comparison. With an inner (tile) loop, the outer blocks are all counted and the
  inner loop's count is multiplied by its trip count (supplied by the caller). Blocks
  reached only through a branch out of the loop are not part of it. For the multi-warp
  prefill, `plain_*` counts the lightest path through one iteration that passes every
  block with a cp.async copy or an HMMA: its plain stages (every score of a warp's rows
  unmasked, no soft-cap, no ALiBi: `prefill/tiled.rs`) take it.
* the dependent chain is the longest path through one iteration's instructions in
  address order over register (R, UR, P, UP) dependencies, with the latencies in
  LATENCY below (published microbenchmark figures for Ampere/Hopper, rounded up). A
  barrier waits for everything before it. Loop-carried dependencies and the latency
  of the cp.async data itself (the memory-latency bound) are not in the chain.
"""
import re
import sys
from collections import defaultdict

HEADER = re.compile(r"^//-+ \.text\.(\S+)\s+-+$", re.M)
INSTR = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;(?:\s*/\* 0x([0-9a-f]{16}) \*/)?")
# `nvdisasm -hex`: the second 64-bit word of a 128-bit instruction, on a line of its own.
HIGH_WORD = re.compile(r"^\s*/\* 0x([0-9a-f]{16}) \*/\s*$")
LABEL = re.compile(r"^(\.L_x_\d+):")
TARGET = re.compile(r"`\((\.L_x_\d+)\)")
PRED = re.compile(r"^@!?U?P[T0-9]+\s+")
REG = re.compile(r"\b(U?R\d+|U?P\d+)(\.64)?\b")

# Cycles from issue to a dependent instruction's issue (approximate, Ampere/Hopper).
LATENCY = {
    "MUFU": 18, "SHFL": 24, "LDS": 30, "LDSM": 30, "LDG": 300, "LD": 300,
    "LDC": 12, "ULDC": 12, "HMMA": 32, "I2F": 6, "F2I": 6, "I2FP": 6, "F2F": 6,
    "F2FP": 5, "HADD2": 5, "HFMA2": 5, "HMUL2": 5, "S2R": 20, "S2UR": 20,
    "BAR": 20, "IMAD": 4,
}
DEFAULT_LATENCY = 4
NO_DEST = ("ST", "STS", "STG", "LDGSTS", "BAR", "DEPBAR", "LDGDEPBAR", "BRA", "EXIT",
           "BSSY", "BSYNC", "WARPSYNC", "NOP", "CALL", "RET", "BPT", "RED", "ATOM")


def ldsm_matrices(op):
    """The 8x8 matrices an LDSM loads (`LDSM.16.M88.4`, `LDSM.16.MT88.2`: the last
    field), 128 bytes and one destination register each."""
    last = op.rsplit(".", 1)[-1]
    return int(last) if last in ("1", "2", "4") else 1


class Instr:
    def __init__(self, addr, text):
        self.addr = addr
        self.ctrl = None  # bits 105-127 of the instruction (nvdisasm -hex), or None
        self.low_word = False
        self.pred = bool(PRED.match(text))
        body = PRED.sub("", text)
        parts = body.split(None, 1)
        self.op = parts[0]
        self.base = self.op.split(".")[0]
        self.args = parts[1] if len(parts) > 1 else ""
        self.target = None
        m = TARGET.search(self.args)
        if m:
            self.target = m.group(1)

    def regs(self):
        """(destinations, sources): register names, 64-bit and vector operands widened."""
        ops = [o.strip() for o in self.args.split(",")]
        width = 4 if ".128" in self.op else 2 if ".64" in self.op or ".WIDE" in self.op else 1
        if self.base == "HMMA":
            width = 4
        if self.base == "LDSM":
            width = ldsm_matrices(self.op)

        def expand(o, w):
            out = []
            for m in REG.finditer(o):
                name, wide = m.group(1), m.group(2)
                n = 2 if wide else w
                if name.startswith(("R", "UR")) and name not in ("RZ", "URZ"):
                    pre = "UR" if name.startswith("UR") else "R"
                    k = int(name[len(pre):])
                    out += [f"{pre}{k + i}" for i in range(n)]
                elif name[-1].isdigit():
                    out.append(name)
            return out

        if self.base in NO_DEST or self.base.startswith("ST"):
            return [], sum((expand(o, 1) for o in ops), [])
        # Destinations lead: the first operand, then any predicates written beside it
        # (`IADD3 R4, P0, PT, …` carries, `ISETP P0, PT, …`), and, after a leading
        # predicate, the register it guards (`SHFL.BFLY PT, R3, …`, `LOP3 P0, RZ, …`).
        is_pred = lambda o: re.fullmatch(r"U?P(T|\d+)", o) is not None
        is_reg = lambda o: re.fullmatch(r"U?R(Z|\d+)(\.64)?", o) is not None
        lead = 1
        while lead < len(ops) and is_pred(ops[lead]):
            lead += 1
        if ops and is_pred(ops[0]) and lead == 1 and len(ops) > 1 and is_reg(ops[1]):
            lead = 2
        dst = sum((expand(o, width if k == lead - 1 or lead == 1 else 1)
                   for k, o in enumerate(ops[:lead])), []) if ops else []
        src = sum((expand(o, 1) for o in ops[lead:]), [])
        if self.pred:
            src += dst  # a predicated write keeps the old value
        return dst, src


def sections(text):
    heads = list(HEADER.finditer(text))
    for i, h in enumerate(heads):
        end = heads[i + 1].start() if i + 1 < len(heads) else len(text)
        yield h.group(1), text[h.end():end].split("//--------------------- SYMBOLS", 1)[0]


def parse(body):
    instrs, labels = [], {}
    pending = []
    for line in body.splitlines():
        m = LABEL.match(line.strip())
        if m:
            pending.append(m.group(1))
            continue
        m = HIGH_WORD.match(line)
        if m and instrs and instrs[-1].ctrl is None and instrs[-1].low_word:
            instrs[-1].ctrl = int(m.group(1), 16) >> 41
            continue
        m = INSTR.match(line)
        if m:
            ins = Instr(int(m.group(1), 16), m.group(2))
            ins.low_word = m.group(3) is not None
            for lb in pending:
                labels[lb] = len(instrs)
            pending = []
            instrs.append(ins)
    return instrs, labels


# The pipe class of an instruction for the replay in examples/decode_model (its
# `Class`): which unit issues it and so how long it holds that unit, and whether its
# result comes by a fixed latency (the control codes' stall counts cover it) or through
# a scoreboard (a latency the model supplies).
CLASS = {
    "FFMA": "fma", "FMUL": "fma", "FADD": "fma", "FCHK": "fma",
    "HFMA2": "half", "HADD2": "half", "HMUL2": "half", "HMNMX2": "half",
    "IMAD": "imad", "IMUL": "imad",
    "MUFU": "mufu", "I2F": "conv", "F2I": "conv", "F2F": "conv", "FRND": "conv",
    "SHFL": "shfl", "LDS": "lds", "LDSM": "ldsm", "STS": "sts", "LDGSTS": "ldgsts",
    "LDG": "ldg", "LD": "ldg", "LDL": "ldg", "STG": "stg", "ST": "stg", "STL": "stg",
    "RED": "stg", "ATOM": "stg", "ATOMG": "stg", "LDC": "ldc", "S2R": "s2r",
    "HMMA": "hmma", "BAR": "bar", "DEPBAR": "depbar",
    "BRA": "branch", "BSSY": "branch", "BSYNC": "branch", "WARPSYNC": "branch",
    "EXIT": "branch", "NOP": "branch", "BREAK": "branch", "CALL": "branch", "RET": "branch",
    "LDGDEPBAR": "branch", "BPT": "branch",
}


def pipe_class(ins):
    """(class, size): `size` is the bytes a shared-memory access moves for the whole warp
    (lds/ldsm/sts/ldgsts) or the m16n8k16-equivalents of an HMMA (16816: 2, 1688: 1)."""
    if ins.base.startswith("U") and ins.base not in CLASS:
        return "uniform", 0  # the uniform datapath, beside the warp's vector pipes
    cls = CLASS.get(ins.base, "alu")
    size = 0
    if cls in ("lds", "sts"):
        size = 512 if ".128" in ins.op else 256 if ".64" in ins.op else 128
    elif cls == "ldsm":
        size = 128 * ldsm_matrices(ins.op)
    elif cls == "ldgsts":
        size = 512 if ".128" in ins.op else 256 if ".64" in ins.op else 128
    elif cls == "hmma":
        size = 1 if ".1688" in ins.op else 2
    return cls, size


def trace(seq):
    """One token per instruction for the replay: `class.size.stall.wb.rb.wait` from the
    control code (stall cycles bits 105-108, write scoreboard 110-112, read scoreboard
    113-115, wait mask 116-121 of the 128-bit instruction; 7 = no scoreboard)."""
    out = []
    for ins in seq:
        if ins.ctrl is None:
            raise SystemExit(f"decode-model: no control word at {ins.addr:#x}: run nvdisasm with -hex")
        c = ins.ctrl
        cls, size = pipe_class(ins)
        out.append(f"{cls}.{size}.{c & 15}.{(c >> 5) & 7}.{(c >> 8) & 7}.{(c >> 11) & 63}")
    return ",".join(out)


def blocks_of(instrs, labels):
    leaders = {0}
    for i, ins in enumerate(instrs):
        if ins.target is not None and ins.target in labels:
            leaders.add(labels[ins.target])
        if ins.base in ("BRA", "EXIT", "RET", "BPT") and i + 1 < len(instrs):
            leaders.add(i + 1)
    starts = sorted(leaders)
    spans = [(s, (starts[k + 1] if k + 1 < len(starts) else len(instrs))) for k, s in enumerate(starts)]
    index = {s: k for k, (s, _) in enumerate(spans)}
    succ = defaultdict(set)
    for k, (s, e) in enumerate(spans):
        last = instrs[e - 1]
        falls = k + 1 < len(spans)
        if last.base == "BRA":
            if last.target in labels:
                succ[k].add(index[labels[last.target]])
            falls = falls and last.pred
        elif last.base in ("EXIT", "RET", "BPT") and not last.pred:
            falls = False
        if falls:
            succ[k].add(k + 1)
    return spans, succ


def dominators(n, succ):
    pred = defaultdict(set)
    for u, vs in succ.items():
        for v in vs:
            pred[v].add(u)
    full = set(range(n))
    dom = [full.copy() for _ in range(n)]
    dom[0] = {0}
    changed = True
    while changed:
        changed = False
        for v in range(1, n):
            ps = [dom[p] for p in pred[v]]
            new = (set.intersection(*ps) if ps else set()) | {v}
            if new != dom[v]:
                dom[v], changed = new, True
    return dom, pred


def natural_loops(n, succ):
    dom, pred = dominators(n, succ)
    loops = defaultdict(set)
    for u, vs in succ.items():
        for h in vs:
            if h in dom[u]:  # back edge u -> h
                body, stack = {h, u}, [u]
                while stack:
                    x = stack.pop()
                    for p in pred[x]:
                        if p not in body:
                            body.add(p)
                            stack.append(p)
                loops[h] |= body
    return loops


def longest_path(blocks, succ, head, spans, instrs, weight):
    """The most instructions (by `weight`) on a path through one iteration of the loop
    `blocks` with header `head`: from the header along forward edges to a block with a
    back edge to it. Returns (count, the blocks of that path)."""
    order = sorted(blocks, key=lambda b: spans[b][0])
    best = {head: (weight(head), [head])}
    result = (0, [])
    for b in order:
        if b not in best:
            continue
        w, path = best[b]
        for v in succ[b]:
            if v == head:
                result = max(result, (w, path))
            elif v in blocks and spans[v][0] > spans[b][0]:
                cand = (w + weight(v), path + [v])
                if v not in best or cand[0] > best[v][0]:
                    best[v] = cand
    return result


def via_shortest(blocks, succ, head, spans, weight, must):
    """The blocks of the lightest path (by `weight`) through one iteration of the loop
    `blocks` (header `head` to a back edge, forward edges only) that passes every block
    of `must` (in address order); [] when there is none."""
    def lightest(src, dst):
        # dst None: any block with a back edge to the header.
        order = sorted(blocks, key=lambda b: spans[b][0])
        best = {src: (weight(src), [src])}
        found = None
        for b in order:
            if b not in best:
                continue
            w, path = best[b]
            if b == dst or (dst is None and head in succ[b]):
                if found is None or w < found[0]:
                    found = (w, path)
                if b == dst:
                    continue
            for v in succ[b]:
                if v in blocks and v != head and spans[v][0] > spans[b][0]:
                    cand = (w + weight(v), path + [v])
                    if v not in best or cand[0] < best[v][0]:
                        best[v] = cand
        return found
    path, at = [], head
    for m in [b for b in must if b != head] + [None]:
        leg = lightest(at, m)
        if leg is None:
            return []
        path += leg[1] if not path else leg[1][1:]
        at = m
    return path


def chain(seq):
    """Longest register-dependency path (cycles) through instructions in order."""
    ready = {}
    barrier = 0
    longest = 0
    for ins in seq:
        dst, src = ins.regs()
        start = max([barrier] + [ready.get(r, 0) for r in src])
        done = start + LATENCY.get(ins.base, DEFAULT_LATENCY)
        if ins.base == "BAR":
            start = done = max(longest, start) + LATENCY["BAR"]
            barrier = done
        for r in dst:
            ready[r] = done
        longest = max(longest, done)
    return longest


def counts(seq):
    c = defaultdict(int)
    for ins in seq:
        c["instr"] += 1
        if ins.base == "LDGSTS":
            c["ldgsts"] += 1
        if ins.op == "MUFU.EX2":
            c["ex2"] += 1
        if ins.base == "MUFU":
            c["mufu"] += 1
        if ins.base == "SHFL":
            c["shfl"] += 1
        if ins.base == "LDS":
            c["lds_bytes"] += 512 if ".128" in ins.op else 256 if ".64" in ins.op else 128
        if ins.base == "LDSM":
            c["lds_bytes"] += 128 * ldsm_matrices(ins.op)
        if ins.base in ("FFMA", "FMUL", "FADD", "HFMA2", "HADD2", "HMUL2"):
            c["fp"] += 1
        if ins.base in ("FFMA", "FMUL"):
            c[ins.base.lower()] += 1
        if ins.base == "HMMA":
            c["hmma"] += 1
        if ins.base in ("BAR", "DEPBAR"):
            c[ins.base.lower()] += 1
        if ins.base == "NOP":
            c["nop"] += 1
    return c


def fmt(prefix, c):
    keys = ["instr", "ldgsts", "ex2", "mufu", "shfl", "lds_bytes", "fp", "ffma", "fmul", "hmma", "bar",
            "depbar", "nop"]
    return " ".join(f"{prefix}{k}={c.get(k, 0)}" for k in keys)


def stage_kernel(name):
    """Whether `name` runs a cp.async stage loop this script models: every decode
    kernel, and the multi-warp prefill kernels (`paged_prefill_attention_*_d<N>`)."""
    return name.startswith("paged_decode_attention") or (
        name.startswith("paged_prefill_attention") and re.search(r"_d\d+$", name) is not None)


def analyse(name, body, anchor=False):
    instrs, labels = parse(body)
    spans, succ = blocks_of(instrs, labels)
    loops = natural_loops(len(spans), succ)
    seq_of = lambda blocks: [instrs[i] for b in sorted(blocks) for i in range(*spans[b])]
    out = []
    ordered = sorted(loops.items(), key=lambda kv: spans[kv[0]][0])
    for h, body_blocks in ordered:
        seq = seq_of(body_blocks)
        ops = {i.base for i in seq}
        inner = [(h2, b2) for h2, b2 in loops.items() if h2 != h and b2 < body_blocks]
        if anchor or stage_kernel(name):
            if not {"LDGSTS", "BAR", "DEPBAR"} <= ops:
                continue
            # innermost such loop: no inner loop also holds the copies
            if any({"LDGSTS", "BAR"} <= {i.base for i in seq_of(b2)} for _, b2 in inner):
                continue
            tiles = [(h2, b2) for h2, b2 in inner if "MUFU" in {i.base for i in seq_of(b2)}]
            nested = [b2 for _, b2 in inner if not any(b2 <= t for _, t in tiles)]
            if len(tiles) > 1 or nested:
                out.append(f"kernel={name} loop_at={instrs[spans[h][0]].addr:#x} modelled=no "
                           f"reason=inner_loops:{len(inner)}")
                continue
            tile_blocks = tiles[0][1] if tiles else set()
            tile = seq_of(tile_blocks)
            if tiles:
                outer = seq_of(body_blocks - tile_blocks)
            else:
                # One iteration's longest path (a warp takes one side of a uniform
                # branch); `all` counts every block.
                size = lambda b: spans[b][1] - spans[b][0]
                n_path, path = longest_path(body_blocks, succ, h, spans, instrs, size)
                outer = seq_of(set(path))
                out_all = len(seq_of(body_blocks))
                # The plain path: the fewest instructions through one iteration that
                # still pass every block with a cp.async copy or an HMMA (the stage's
                # copies and matrix work); in the multi-warp prefill, the stages
                # inside every row's range with no soft-cap and no ALiBi.
                must = sorted((b for b in body_blocks
                               if any(instrs[i].base in ("LDGSTS", "HMMA")
                                      for i in range(*spans[b]))),
                              key=lambda b: spans[b][0])
                plain = seq_of(set(via_shortest(body_blocks, succ, h, spans, size, must)))
            c_out, c_tile = counts(outer), counts(tile)
            # The replay's traces: one iteration's path, the code before the loop and
            # after it up to the first unconditional EXIT (every block, both sides of
            # a branch: an over-estimate of a warp's prologue and epilogue).
            first = min(spans[b][0] for b in body_blocks)
            last = max(spans[b][1] for b in body_blocks)
            end = next((k + 1 for k in range(last, len(instrs))
                        if instrs[k].base == "EXIT" and not instrs[k].pred), len(instrs))
            traces = (f" stage_trace={trace(outer)} pre_trace={trace(instrs[:first])}"
                      f" post_trace={trace(instrs[last:end])}"
                      + (f" tile_trace={trace(tile)}" if tiles else ""))
            # A tensor-core loop (HMMA) serves a whole stage per iteration: no tile.
            mma = c_out["hmma"] + c_tile["hmma"] > 0
            n = 0 if mma else (c_tile["ex2"] - 1) if tiles else (c_out["ex2"] - 1)
            out.append(
                f"kernel={name} loop_at={instrs[spans[h][0]].addr:#x} modelled=yes "
                f"kind={'mma' if mma else 'simt'} tile={n} "
                f"tile_loop={'yes' if tiles else 'no'} "
                f"stage_all_instr={out_all if not tiles else len(outer)} "
                f"{fmt('stage_', c_out)} {fmt('tile_', c_tile)} "
                f"stage_chain={chain(outer)} tile_chain={chain(tile)}"
                + (f" {fmt('plain_', counts(plain))} plain_chain={chain(plain)}"
                   f" plain_trace={trace(plain)}"
                   if not tiles and plain and (anchor or name.startswith("paged_prefill")) else "")
                + traces)
        elif name.startswith("paged_decode_reduce"):
            if inner or not ({"LDG", "LD"} & ops):
                continue
            c = counts(seq)
            loads = sum(1 for i in seq if i.base in ("LDG", "LD"))
            # Run once per thread: the code before the loop, and after it up to the
            # first unconditional EXIT (the lanes' shuffle merge and the store; both
            # sides of a branch are in the chain, an over-estimate).
            first = min(spans[b][0] for b in body_blocks)
            last = max(spans[b][1] for b in body_blocks)
            end = next((k + 1 for k in range(last, len(instrs))
                        if instrs[k].base == "EXIT" and not instrs[k].pred), len(instrs))
            out.append(f"kernel={name} loop_at={instrs[spans[h][0]].addr:#x} modelled=yes "
                       f"{fmt('iter_', c)} iter_loads={loads} iter_chain={chain(seq)} "
                       f"pre_chain={chain(instrs[:first])} post_chain={chain(instrs[last:end])} "
                       f"post_shfl={counts(instrs[last:end])['shfl']} "
                       f"iter_trace={trace(seq)} pre_trace={trace(instrs[:first])} "
                       f"post_trace={trace(instrs[last:end])}")
    if not out and name.startswith("paged_decode_reduce"):
        c = counts(instrs)
        out.append(f"kernel={name} loop_at=none modelled=yes {fmt('iter_', c)} "
                   f"iter_loads={sum(1 for i in instrs if i.base in ('LDG', 'LD'))} "
                   f"iter_chain={chain(instrs)}")
    return out


def main():
    args = sys.argv[1:]
    anchor = None
    if len(args) == 4 and args[0] == "--anchor":
        anchor, args = args[1], args[2:]
    if len(args) != 2:
        raise SystemExit("usage: decode-model.py [--anchor NAME] ARCH FILE.sass")
    arch, path = args
    text = open(path, encoding="utf-8", errors="replace").read()
    for name, body in sections(text):
        if anchor is not None:
            # An anchor's file holds one kernel (FlashInfer's, ptx/anchors/): its stage
            # loop, reported under the anchor's name.
            for line in analyse(name, body, anchor=True):
                print(f"arch={arch} {line.replace(f'kernel={name}', f'kernel={anchor}', 1)}")
        elif stage_kernel(name) or name.startswith("paged_decode_reduce"):
            for line in analyse(name, body):
                print(f"arch={arch} {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
