//! The decoded form of a kernel: one [`Inst`] per PTX instruction, registers numbered
//! densely per function, immediates already in their instruction type's bits, labels
//! resolved to instruction indices, symbols to addresses.

/// A register number, an index into a thread's register file.
pub(crate) type Reg = u32;

/// A source operand.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Src {
    /// A register's bits.
    R(Reg),
    /// Immediate bits, already encoded as the instruction's type (an `f32` is its bits).
    I(u64),
}

/// An address operand `[base+off]`: `base` is a register (`None`: an absolute address,
/// e.g. a `.param` symbol's offset).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Addr {
    pub(crate) base: Option<Reg>,
    pub(crate) off: i64,
}

/// Two-operand arithmetic, with its type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum BinOp {
    Add16,
    Add32,
    Add64,
    Sub16,
    Sub32,
    Sub64,
    MulLo16,
    MulLo32,
    MulLo64,
    MulWideU16,
    MulWideU32,
    And16,
    And32,
    And64,
    Or16,
    Or32,
    Or64,
    Xor16,
    Xor32,
    Shl16,
    Shl32,
    Shl64,
    ShrU16,
    ShrU32,
    ShrU64,
    MinU32,
    MaxU32,
    DivU16,
    DivU32,
    DivU64,
    RemU32,
    RemU64,
    AddF32,
    SubF32,
    MulF32,
    /// `mul.rn.f16x2`: per 16-bit half, the f16 product rounded to nearest even.
    MulF16x2,
    DivF32,
    AndPred,
    OrPred,
    /// `cvt.rn.satfinite.e4m3x2.f32 d, a, b`: `a` to the upper byte, `b` the lower.
    E4m3x2FromF32,
    /// `cvt.rn.satfinite.e5m2x2.f32 d, a, b`.
    E5m2x2FromF32,
}

/// One-operand operations and conversions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum UnOp {
    /// `mov`, `cvta`, and zero-extending or truncating integer `cvt` are this with a
    /// width mask.
    Mov,
    Not16,
    Not32,
    NotPred,
    Neg32,
    Popc32,
    Clz32,
    /// `cvt.u16.u32`: the low 16 bits.
    Trunc16,
    /// `cvt.u32.u64`: the low 32 bits.
    Trunc32,
    /// `cvt.rn.f32.u32`.
    F32FromU32,
    /// `cvt.f32.f16`.
    F32FromF16,
    /// `cvt.rn.f16.f32`.
    F16FromF32,
    /// `cvt.rn.bf16.f32`.
    Bf16FromF32,
    /// `rcp.rn.f32`.
    RcpF32,
    /// `ex2.approx.ftz.f32`.
    Ex2ApproxFtz,
    /// `tanh.approx.f32`.
    TanhApprox,
    /// `lg2.approx.ftz.f32`.
    Lg2ApproxFtz,
    /// `cvt.rn.f16x2.e4m3x2`.
    F16x2FromE4m3x2,
    /// `cvt.rn.f16x2.e5m2x2`.
    F16x2FromE5m2x2,
}

/// Three-operand arithmetic.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum TernOp {
    MadLo32,
    MadLo64,
    FmaF32,
    /// `bfe.u32 d, a, pos, len`.
    BfeU32,
    /// `shf.l.wrap.b32 d, a, b, n`: the high word of `{b, a} << (n & 31)`.
    ShfLWrap32,
    /// `prmt.b32 d, a, b, sel` (default mode): byte `i` of `d` is byte `sel[4i+2:4i]`
    /// of `{b, a}`, or its sign replicated when `sel[4i+3]` is set.
    PrmtB32,
}

/// The type a `setp` compares as.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum CmpTy {
    U16,
    U32,
    U64,
    S16,
    S32,
    S64,
    F32,
}

/// A `setp` comparison; `Equ` .. `Geu` are the unordered float forms (true if either
/// operand is NaN); the plain float forms are ordered (false on NaN, `ne` included).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum CmpOp {
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
    Equ,
    Neu,
    Ltu,
    Leu,
    Gtu,
    Geu,
}

/// A state space of a load or store.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Space {
    /// The entry's by-value parameters.
    Param,
    /// `.global` (after `cvta.to.global`).
    Global,
    /// A generic address: must resolve to global memory (the PTX has no `cvta.shared`).
    Generic,
    /// The CTA's dynamic shared memory.
    Shared,
}

/// The special registers a kernel may read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Special {
    Tid(u8),
    Ntid(u8),
    Ctaid(u8),
    Nctaid(u8),
}

/// One decoded operation.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Op {
    Bin {
        op: BinOp,
        d: Reg,
        a: Src,
        b: Src,
    },
    /// `mask`: the destination width's bit mask (integer moves and conversions).
    Un {
        op: UnOp,
        d: Reg,
        a: Src,
        mask: u64,
    },
    Tern {
        op: TernOp,
        d: Reg,
        a: Src,
        b: Src,
        c: Src,
    },
    Setp {
        ty: CmpTy,
        cmp: CmpOp,
        d: Reg,
        a: Src,
        b: Src,
    },
    Selp {
        d: Reg,
        a: Src,
        b: Src,
        p: Reg,
    },
    /// `mov.bN {lo, hi}, a`: split `a` into halves of `half` bits (`None`: the sink `_`).
    Unpack {
        lo: Option<Reg>,
        hi: Option<Reg>,
        a: Src,
        half: u32,
    },
    /// `mov.bN d, {lo, hi}`.
    Pack {
        d: Reg,
        lo: Src,
        hi: Src,
        half: u32,
    },
    Special {
        d: Reg,
        s: Special,
    },
    /// `n` elements of `bytes` bytes each (`n` 1 or 4); `nc`: `ld.global.nc`.
    Ld {
        space: Space,
        bytes: u8,
        n: u8,
        nc: bool,
        d: [Reg; 4],
        addr: Addr,
    },
    St {
        space: Space,
        bytes: u8,
        n: u8,
        v: [Src; 4],
        addr: Addr,
    },
    /// `cp.async.cg.shared.global [dst], [src], bytes{, src_size}`: reads `src_size`
    /// bytes (all `bytes` without it) and zero-fills the rest.
    CpAsync {
        dst: Addr,
        src: Addr,
        bytes: u32,
        src_size: Option<Src>,
    },
    CpCommit,
    CpWait(u32),
    Bar,
    /// `shfl.sync.bfly.b32 d, a, lane, clamp, membermask`.
    Shfl {
        d: Reg,
        a: Src,
        lane: Src,
        clamp: Src,
        mask: Src,
    },
    /// `ldmatrix.sync.aligned.m8n8.xN{.trans}.shared.b16`.
    Ldmatrix {
        n: u8,
        trans: bool,
        d: [Reg; 4],
        addr: Addr,
    },
    /// `mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.{f16,bf16}.f32`.
    Mma {
        bf16: bool,
        d: [Reg; 4],
        a: [Src; 4],
        b: [Src; 2],
        c: [Src; 4],
    },
    Bra(u32),
    Exit,
    Ret,
    Trap,
    /// A call of a `.noreturn` function (the Rust panic functions), its one argument
    /// (a generic pointer to a `core::panic::Location`) if it takes one.
    Call {
        func: u32,
        arg: Option<Src>,
    },
}

/// An instruction: an optional guard predicate (`@%p` / `@!%p`), the operation, and
/// the PTX source line it came from.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Inst {
    pub(crate) guard: Option<(Reg, bool)>,
    pub(crate) op: Op,
    pub(crate) line: u32,
}

/// A classification of instructions for the launch counters.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum InstClass {
    /// Integer arithmetic, logic, moves, conversions between integers, predicates.
    Integer,
    /// `f32` arithmetic and conversions involving floats.
    Float,
    /// `ex2.approx`, `tanh.approx`, `rcp`, `div.rn.f32`.
    Special,
    /// Loads and stores of every space, `cp.async` and its group operations.
    Memory,
    /// `bar.sync`, `shfl.sync`, `ldmatrix`.
    Sync,
    /// `mma.sync`.
    TensorCore,
    /// Branches, exits, traps, calls.
    Control,
}

impl InstClass {
    /// Every class, in counter order.
    pub const ALL: [InstClass; 7] = [
        InstClass::Integer,
        InstClass::Float,
        InstClass::Special,
        InstClass::Memory,
        InstClass::Sync,
        InstClass::TensorCore,
        InstClass::Control,
    ];
}

impl Op {
    /// Its counter class.
    pub(crate) fn class(&self) -> InstClass {
        use BinOp::*;
        match self {
            Op::Bin { op, .. } => match op {
                AddF32 | SubF32 | MulF32 | MulF16x2 | E4m3x2FromF32 | E5m2x2FromF32 => {
                    InstClass::Float
                }
                DivF32 => InstClass::Special,
                _ => InstClass::Integer,
            },
            Op::Un { op, .. } => match op {
                UnOp::RcpF32 | UnOp::Ex2ApproxFtz | UnOp::TanhApprox | UnOp::Lg2ApproxFtz => {
                    InstClass::Special
                }
                UnOp::F32FromU32
                | UnOp::F32FromF16
                | UnOp::F16FromF32
                | UnOp::Bf16FromF32
                | UnOp::F16x2FromE4m3x2
                | UnOp::F16x2FromE5m2x2 => InstClass::Float,
                _ => InstClass::Integer,
            },
            Op::Tern { op, .. } => match op {
                TernOp::FmaF32 => InstClass::Float,
                _ => InstClass::Integer,
            },
            Op::Setp { ty, .. } => {
                if *ty == CmpTy::F32 {
                    InstClass::Float
                } else {
                    InstClass::Integer
                }
            }
            Op::Selp { .. } | Op::Unpack { .. } | Op::Pack { .. } | Op::Special { .. } => {
                InstClass::Integer
            }
            Op::Ld { .. } | Op::St { .. } | Op::CpAsync { .. } | Op::CpCommit | Op::CpWait(_) => {
                InstClass::Memory
            }
            Op::Bar | Op::Shfl { .. } | Op::Ldmatrix { .. } => InstClass::Sync,
            Op::Mma { .. } => InstClass::TensorCore,
            Op::Bra(_) | Op::Exit | Op::Ret | Op::Trap | Op::Call { .. } => InstClass::Control,
        }
    }
}
