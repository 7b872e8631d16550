//! One test per instruction form the kernels use whose semantics are more than
//! arithmetic, each on distinct values, against expectations written here from the PTX
//! ISA (not from the interpreter's or the emulator's code): ldmatrix (x1/x2/x4, plain
//! and `.trans`), mma m16n8k16 (f16 and bf16), shfl.sync.bfly with a clamp, setp's
//! ordered and unordered NaN rules, ex2's `.ftz`, the 16- and 8-bit float conversions
//! and the integer forms with edge cases.

mod kit;

use kit::{launch, word_addr};
use pagedkv_kernels::Access;
use pagedkv_ptx_interp::MathMode;

fn run(body: &str, threads: u32, shared: u32, buf: &mut [u32]) {
    launch(
        body,
        threads,
        shared,
        buf,
        Access::ReadWrite,
        MathMode::Exact,
    )
    .unwrap();
}

/// Shared memory holds 32 rows of 8 16-bit elements, element (row q, column c) =
/// `8q + c`, rows 16 bytes apart. Lane l supplies the address of row `p(l) = (5l + 3) %
/// 32` (a permutation, so a model that derives rows from lane 0's address fails);
/// lanes past the `8n` an `.xn` reads supply an address outside shared memory, which
/// must be ignored. Per the ISA, matrix j's row r is the row lane `8j + r` addresses, and
/// lane l's register j holds matrix j's elements (row l/4, columns 2(l%4), 2(l%4)+1),
/// low half first; with `.trans` (rows 2(l%4), 2(l%4)+1, column l/4).
#[test]
fn ldmatrix_distributes_rows_as_the_isa_says() {
    for (n, trans) in [
        (1u32, false),
        (2, false),
        (4, false),
        (1, true),
        (2, true),
        (4, true),
    ] {
        let regs: Vec<String> = (0..n).map(|j| format!("%r{}", 10 + j)).collect();
        let stores: String = (0..n)
            .map(|j| {
                format!(
                    "\tshl.b32 %r20, %r1, 2;\n\tadd.s32 %r20, %r20, {j};\n{}\tst.global.u32 [%rd5], %r{};\n",
                    word_addr(5, 20),
                    10 + j
                )
            })
            .collect();
        let body = format!(
            // Each thread writes 4 words: word w = (2w, 2w + 1).
            "\tmov.b32 %r2, 0;\n$L__fill:\n\
             \tshl.b32 %r3, %r1, 2;\n\tadd.s32 %r3, %r3, %r2;\n\
             \tshl.b32 %r4, %r3, 1;\n\tadd.s32 %r5, %r4, 1;\n\tshl.b32 %r5, %r5, 16;\n\tor.b32 %r4, %r4, %r5;\n\
             \tshl.b32 %r6, %r3, 2;\n\tcvt.u64.u32 %rd6, %r6;\n\tadd.s64 %rd7, %rd3, %rd6;\n\
             \tst.shared.u32 [%rd7], %r4;\n\tadd.s32 %r2, %r2, 1;\n\tsetp.lt.u32 %p1, %r2, 4;\n\
             \t@%p1 bra $L__fill;\n\tbar.sync 0;\n\
             \tmul.lo.s32 %r7, %r1, 5;\n\tadd.s32 %r7, %r7, 3;\n\tand.b32 %r7, %r7, 31;\n\
             \tshl.b32 %r7, %r7, 4;\n\tsetp.lt.u32 %p2, %r1, {lanes};\n\tselp.b32 %r7, %r7, 4096, %p2;\n\
             \tcvt.u64.u32 %rd8, %r7;\n\tadd.s64 %rd9, %rd3, %rd8;\n\
             \tldmatrix.sync.aligned.m8n8.x{n}{}.shared.b16 {{{}}}, [%rd9];\n{stores}",
            if trans { ".trans" } else { "" },
            regs.join(", "),
            lanes = 8 * n,
        );
        let mut buf = vec![0u32; 128];
        run(&body, 32, 512, &mut buf);
        for l in 0..32u32 {
            let (g, t) = (l / 4, l % 4);
            for j in 0..n {
                let e = |r: u32, c: u32| 8 * ((5 * (8 * j + r) + 3) % 32) + c;
                let (lo, hi) = if trans {
                    (e(2 * t, g), e(2 * t + 1, g))
                } else {
                    (e(g, 2 * t), e(g, 2 * t + 1))
                };
                assert_eq!(
                    buf[(4 * l + j) as usize],
                    lo | hi << 16,
                    "x{n} trans {trans}: lane {l}, reg {j}"
                );
            }
        }
    }
}

fn f16_bits(x: f32) -> u32 {
    // Small integers only: exact in f16.
    let (s, a) = (if x < 0.0 { 0x8000 } else { 0 }, x.abs());
    if a == 0.0 {
        return s;
    }
    let e = a.log2().floor() as i32;
    let m = ((a / 2f32.powi(e) - 1.0) * 1024.0) as u32;
    s | (((e + 15) as u32) << 10) | m
}

/// A (16x16, row-major) times B (16x8) plus C (16x8 f32) with distinct small-integer
/// values (exact in f16, bf16 and f32), fragments laid out by the ISA's tables:
/// A's register j of lane (g, t) holds (row g + 8(j%2), columns 2t + 8(j/2) + {0,1});
/// B's register j holds (rows 2t + 8j + {0,1}, column g); C/D element j is
/// (row g + 8(j/2), column 2t + j%2).
#[test]
fn mma_m16n8k16_multiplies_as_the_isa_lays_out_fragments() {
    for bf16 in [false, true] {
        let a = |r: usize, k: usize| ((r * 16 + k) % 7) as f32 - 3.0;
        let b = |k: usize, n: usize| ((k * 8 + n) % 5) as f32 - 2.0;
        let c = |r: usize, n: usize| (r * 8 + n) as f32 * 0.5;
        let bits = |x: f32| if bf16 { x.to_bits() >> 16 } else { f16_bits(x) };
        // The buffer: per lane 10 input words (a0..a3, b0, b1, c0..c3), then 4 outputs.
        let mut buf = vec![0u32; 32 * 14];
        for l in 0..32 {
            let (g, t) = (l / 4, l % 4);
            for j in 0..4 {
                let (r, k) = (g + 8 * (j % 2), 2 * t + 8 * (j / 2));
                buf[l * 10 + j] = bits(a(r, k)) | bits(a(r, k + 1)) << 16;
                let (r, n) = (g + 8 * (j / 2), 2 * t + j % 2);
                buf[l * 10 + 6 + j] = c(r, n).to_bits();
            }
            for j in 0..2 {
                let k = 2 * t + 8 * j;
                buf[l * 10 + 4 + j] = bits(b(k, g)) | bits(b(k + 1, g)) << 16;
            }
        }
        let loads: String = (0..10)
            .map(|i| format!("\tld.global.u32 %r{}, [%rd5+{}];\n", 10 + i, 4 * i))
            .collect();
        let ty = if bf16 { "bf16" } else { "f16" };
        let body = format!(
            "\tmul.lo.s32 %r2, %r1, 10;\n{}{loads}\
             \tmma.sync.aligned.m16n8k16.row.col.f32.{ty}.{ty}.f32 {{%r30, %r31, %r32, %r33}}, \
             {{%r10, %r11, %r12, %r13}}, {{%r14, %r15}}, {{%r16, %r17, %r18, %r19}};\n\
             \tshl.b32 %r3, %r1, 2;\n\tadd.s32 %r3, %r3, 320;\n{}\
             \tst.global.u32 [%rd6], %r30;\n\tst.global.u32 [%rd6+4], %r31;\n\
             \tst.global.u32 [%rd6+8], %r32;\n\tst.global.u32 [%rd6+12], %r33;\n",
            word_addr(5, 2),
            word_addr(6, 3),
        );
        run(&body, 32, 0, &mut buf);
        for l in 0..32 {
            let (g, t) = (l / 4, l % 4);
            for j in 0..4 {
                let (r, n) = (g + 8 * (j / 2), 2 * t + j % 2);
                let want: f32 = (0..16).map(|k| a(r, k) * b(k, n)).sum::<f32>() + c(r, n);
                let got = f32::from_bits(buf[320 + 4 * l + j]);
                assert_eq!(got, want, "{ty}: D({r}, {n}) from lane {l} reg {j}");
            }
        }
    }
}

/// `shfl.sync.bfly.b32 d, a, b, c, mask`: lane l reads lane l ^ b if that is at most
/// maxLane = (l & segmask) | (c & 0x1f & !segmask), with segmask = c >> 8; else its own
/// value (PTX ISA, "shfl.sync").
#[test]
fn shfl_bfly_respects_the_clamp() {
    for (b, c) in [(1u32, 0x1f_u32), (16, 0x1f), (1, 0x0f), (3, 0x1c07)] {
        let body = format!(
            "\tmul.lo.s32 %r2, %r1, 7;\n\tadd.s32 %r2, %r2, 100;\n\
             \tshfl.sync.bfly.b32 %r3, %r2, {b}, {c}, 0xffffffff;\n{}\tst.global.u32 [%rd5], %r3;",
            word_addr(5, 1)
        );
        let mut buf = vec![0u32; 32];
        run(&body, 32, 0, &mut buf);
        for l in 0..32u32 {
            let seg = (c >> 8) & 0x1f;
            let max = (l & seg) | (c & 0x1f & !seg);
            let j = if l ^ b <= max { l ^ b } else { l };
            assert_eq!(buf[l as usize], 100 + 7 * j, "b {b} c {c:#x}: lane {l}");
        }
    }
}

/// `setp` on floats: the plain comparisons are ordered (false when either operand is
/// NaN, `ne` included), the `u` forms unordered (true then).
#[test]
fn setp_float_nan_rules() {
    let cmps = [
        "eq", "ne", "lt", "le", "gt", "ge", "equ", "neu", "ltu", "leu", "gtu", "geu",
    ];
    let pairs = [
        (1.0f32, 2.0f32),
        (2.0, 2.0),
        (3.0, 2.0),
        (f32::NAN, 1.0),
        (1.0, f32::NAN),
        (-0.0, 0.0),
    ];
    let mut body = String::from("\tld.global.u32 %r2, [%rd2];\n\tld.global.u32 %r3, [%rd2+4];\n");
    for (i, c) in cmps.iter().enumerate() {
        body += &format!(
            "\tsetp.{c}.f32 %p1, %r2, %r3;\n\tselp.b32 %r4, 1, 0, %p1;\n\tst.global.u32 [%rd2+{}], %r4;\n",
            8 + 4 * i
        );
    }
    for (x, y) in pairs {
        let mut buf = vec![0u32; 14];
        buf[0] = x.to_bits();
        buf[1] = y.to_bits();
        run(&body, 1, 0, &mut buf);
        let unordered = x.is_nan() || y.is_nan();
        let want = [
            x == y,
            !unordered && x != y,
            x < y,
            x <= y,
            x > y,
            x >= y,
            unordered || x == y,
            unordered || x != y,
            unordered || x < y,
            unordered || x <= y,
            unordered || x > y,
            unordered || x >= y,
        ];
        for (i, c) in cmps.iter().enumerate() {
            assert_eq!(buf[2 + i] == 1, want[i], "setp.{c} {x} {y}");
        }
    }
}

/// `ex2.approx.ftz.f32` flushes a subnormal input to zero (2^0 = 1) and a subnormal
/// result to zero; the float conversions round to nearest even, `satfinite` clamps the
/// fp8 ones, and `cvt.rn.satfinite.e4m3x2.f32 d, a, b` puts `a` in the upper byte.
#[test]
fn ex2_ftz_and_the_float_conversions() {
    let body = "\tld.global.u32 %r2, [%rd2];\n\tld.global.u32 %r3, [%rd2+4];\n\
        \tex2.approx.ftz.f32 %r4, %r2;\n\tst.global.u32 [%rd2+8], %r4;\n\
        \tcvt.rn.f16.f32 %rs1, %r3;\n\tcvt.u32.u16 %r5, %rs1;\n\tst.global.u32 [%rd2+12], %r5;\n\
        \tcvt.rn.bf16.f32 %rs2, %r3;\n\tcvt.u32.u16 %r6, %rs2;\n\tst.global.u32 [%rd2+16], %r6;\n\
        \tcvt.rn.satfinite.e4m3x2.f32 %rs3, %r3, %r2;\n\tcvt.u32.u16 %r7, %rs3;\n\tst.global.u32 [%rd2+20], %r7;\n\
        \tcvt.rn.satfinite.e5m2x2.f32 %rs4, %r3, %r2;\n\tcvt.u32.u16 %r8, %rs4;\n\tst.global.u32 [%rd2+24], %r8;\n\
        \tcvt.rn.f16x2.e4m3x2 %r9, %rs3;\n\tst.global.u32 [%rd2+28], %r9;\n\
        \tcvt.f32.f16 %r10, %rs1;\n\tst.global.u32 [%rd2+32], %r10;";
    // (x for ex2 and the low fp8 byte, y for the conversions and the high byte)
    let cases: [(f32, f32, f32, u32, u32, u32, u32); 4] = [
        // ex2(3) = 8; 1 + 2^-11 is a tie in f16 (to even: 1.0), in bf16 exact to 1.0.
        (
            3.0,
            1.0 + 2f32.powi(-11),
            8.0,
            0x3C00,
            0x3F80,
            0x3844,
            0x3C42,
        ),
        // A subnormal input flushes: 2^0; 65520 is a tie to even in f16: infinity;
        // fp8 saturates to 448 / 57344.
        (
            f32::from_bits(1),
            65520.0,
            1.0,
            0x7C00,
            0x4780,
            0x7E00,
            0x7B00,
        ),
        // 2^-130 would be subnormal: flushed; -0.0 keeps its sign; -130 rounds to
        // -128 in both fp8 formats.
        (-130.0, -0.0, 0.0, 0x8000, 0x8000, 0x80F0, 0x80D8),
        // ex2(-1) = 0.5; NaN converts to the canonical NaN.
        (-1.0, f32::NAN, 0.5, 0x7FFF, 0x7FFF, 0x7FB8, 0x7FBC),
    ];
    for (x, y, ex2, f16, bf16, e4, e5) in cases {
        let mut buf = vec![0u32; 9];
        buf[0] = x.to_bits();
        buf[1] = y.to_bits();
        run(body, 1, 0, &mut buf);
        assert_eq!(f32::from_bits(buf[2]).to_bits(), ex2.to_bits(), "ex2({x})");
        assert_eq!((buf[3], buf[4]), (f16, bf16), "f16, bf16 of {y}");
        assert_eq!((buf[5], buf[6]), (e4, e5), "e4m3x2, e5m2x2 of ({y}, {x})");
        // Back from e4m3x2: each byte exactly, the upper to the upper half.
        let f16_of_e4m3 = |b: u32| -> u32 {
            match b & 0x7F {
                0x7F => 0x7FFF,
                0 => (b & 0x80) << 8,
                m => {
                    let v = if m >> 3 == 0 {
                        (m & 7) as f32 * 2f32.powi(-9)
                    } else {
                        (1.0 + (m & 7) as f32 / 8.0) * 2f32.powi((m >> 3) as i32 - 7)
                    };
                    ((b & 0x80) << 8) | f16_bits(v)
                }
            }
        };
        assert_eq!(
            buf[7],
            f16_of_e4m3(e4 & 0xFF) | f16_of_e4m3(e4 >> 8) << 16,
            "f16x2 of {e4:#x}"
        );
        if !y.is_nan() && f16 != 0x7C00 {
            assert_eq!(
                f32::from_bits(buf[8]),
                if f16 == 0x3C00 { 1.0 } else { y },
                "f32 of f16 {f16:#x}"
            );
        }
    }
}

/// The integer forms' edge cases: shifts by the width or more, `bfe` past bit 31,
/// `clz`/`popc` of 0, wrapping `mad.lo`/`neg`/`sub.s16`, `mul.wide` of the largest
/// u32s, unsigned `min`/`max`/`div`, `selp`, 64-bit shifts.
#[test]
fn integer_forms_at_their_edges() {
    let body = "\tld.global.u32 %r2, [%rd2];\n\tld.global.u32 %r3, [%rd2+4];\n\
        \tshl.b32 %r4, %r2, 32;\n\tst.global.u32 [%rd2+8], %r4;\n\
        \tshr.u32 %r5, %r2, 31;\n\tst.global.u32 [%rd2+12], %r5;\n\
        \tbfe.u32 %r6, %r2, 28, 8;\n\tst.global.u32 [%rd2+16], %r6;\n\
        \tclz.b32 %r7, %r3;\n\tst.global.u32 [%rd2+20], %r7;\n\
        \tpopc.b32 %r8, %r2;\n\tst.global.u32 [%rd2+24], %r8;\n\
        \tmad.lo.s32 %r9, %r2, %r2, 5;\n\tst.global.u32 [%rd2+28], %r9;\n\
        \tneg.s32 %r10, %r2;\n\tst.global.u32 [%rd2+32], %r10;\n\
        \tmul.wide.u32 %rd10, %r2, %r2;\n\tcvt.u32.u64 %r18, %rd10;\n\tst.global.u32 [%rd2+36], %r18;\n\
        \tst.global.v4.u32 [%rd2+48], {%r2, %r2, %r2, %r2};\n\
        \tshr.u64 %rd11, %rd10, 32;\n\tcvt.u32.u64 %r11, %rd11;\n\tst.global.u32 [%rd2+40], %r11;\n\
        \tmin.u32 %r12, %r2, %r3;\n\tmax.u32 %r13, %r2, %r3;\n\tst.global.u32 [%rd2+44], %r12;\n\tst.global.u32 [%rd2+64], %r13;\n\
        \tdiv.u32 %r14, %r2, 7;\n\tst.global.u32 [%rd2+68], %r14;\n\
        \tcvt.u16.u32 %rs1, %r3;\n\tsub.s16 %rs2, %rs1, 1;\n\tcvt.u32.u16 %r15, %rs2;\n\tst.global.u32 [%rd2+72], %r15;\n\
        \tsetp.gt.u32 %p1, %r2, %r3;\n\tselp.b32 %r16, 11, 22, %p1;\n\tst.global.u32 [%rd2+76], %r16;\n\
        \tshl.b64 %rd12, %rd10, 64;\n\tcvt.u32.u64 %r17, %rd12;\n\tst.global.u32 [%rd2+80], %r17;";
    let mut buf = vec![0u32; 21];
    buf[0] = 0xF000_0001; // x
    buf[1] = 0; // y
    run(body, 1, 0, &mut buf);
    let x = 0xF000_0001u32;
    let wide = x as u64 * x as u64;
    assert_eq!(buf[2], 0, "shl by 32");
    assert_eq!(buf[3], 1, "shr by 31");
    assert_eq!(buf[4], 0xF, "bfe from 28, 8 bits: only 4 exist");
    assert_eq!(buf[5], 32, "clz 0");
    assert_eq!(buf[6], 5, "popc");
    assert_eq!(buf[7], x.wrapping_mul(x).wrapping_add(5), "mad.lo wraps");
    assert_eq!(buf[8], x.wrapping_neg(), "neg wraps");
    assert_eq!(buf[9], wide as u32, "mul.wide low word");
    assert_eq!(buf[10], (wide >> 32) as u32, "mul.wide high word");
    assert_eq!((buf[11], buf[16]), (0, x), "unsigned min, max");
    assert_eq!(buf[17], x / 7, "div.u32");
    assert_eq!(buf[18], 0xFFFF, "sub.s16 wraps in 16 bits");
    assert_eq!(buf[19], 11, "selp");
    assert_eq!(buf[20], 0, "shl.b64 by 64");
    assert_eq!(&buf[12..16], &[x; 4], "st.global.v4");
}

/// The 16-bit forms the decode kernels' geometry arithmetic compiles to: `mul.lo.s16`
/// and `mul.wide.u16` (16 x 16 -> 32 bits), `div.u16`, and `cvt.u16.u64` (truncation).
#[test]
fn sixteen_bit_forms() {
    let body = "\tld.global.u32 %r2, [%rd2];\n\tcvt.u16.u32 %rs1, %r2;\n\
        \tmul.lo.s16 %rs2, %rs1, %rs1;\n\tcvt.u32.u16 %r3, %rs2;\n\tst.global.u32 [%rd2+4], %r3;\n\
        \tmul.wide.u16 %r4, %rs1, %rs1;\n\tst.global.u32 [%rd2+8], %r4;\n\
        \tdiv.u16 %rs3, %rs1, 7;\n\tcvt.u32.u16 %r5, %rs3;\n\tst.global.u32 [%rd2+12], %r5;\n\
        \tld.global.u64 %rd10, [%rd2+16];\n\tcvt.u16.u64 %rs4, %rd10;\n\tcvt.u32.u16 %r6, %rs4;\n\
        \tst.global.u32 [%rd2+24], %r6;";
    let mut buf = vec![0u32; 7];
    buf[0] = 0x0001_F00D; // the u16 is 0xF00D
    buf[4] = 0x89AB_CDEF; // low word of the u64
    buf[5] = 0x0123_4567;
    run(body, 1, 0, &mut buf);
    let x = 0xF00Du32;
    assert_eq!(buf[1], (x * x) & 0xFFFF, "mul.lo.s16 keeps the low 16 bits");
    assert_eq!(buf[2], x * x, "mul.wide.u16 keeps all 32");
    assert_eq!(buf[3], x / 7, "div.u16");
    assert_eq!(buf[6], 0xCDEF, "cvt.u16.u64 truncates");
}

/// `xor.b32`, and the funnel shift `shf.l.wrap.b32 d, a, b, n` (PTX ISA, shf: the high
/// 32 bits of the 64-bit `{b, a}`, b the high word, shifted left by `n & 0x1f`) at a
/// shift of 0, an ordinary one and one that wraps (36 is 4). The fp8 tensor-core
/// decode's K swizzle and sm_80's byte pairing compile to them.
#[test]
fn xor_and_funnel_shift_forms() {
    let body = "\tld.global.u32 %r2, [%rd2];\n\tld.global.u32 %r3, [%rd2+4];\n\
        \txor.b32 %r4, %r2, %r3;\n\tst.global.u32 [%rd2+8], %r4;\n\
        \tshf.l.wrap.b32 %r5, %r2, %r3, 0;\n\tst.global.u32 [%rd2+12], %r5;\n\
        \tshf.l.wrap.b32 %r6, %r2, %r3, 8;\n\tst.global.u32 [%rd2+16], %r6;\n\
        \tshf.l.wrap.b32 %r7, %r2, %r3, 36;\n\tst.global.u32 [%rd2+20], %r7;";
    let mut buf = vec![0u32; 6];
    buf[0] = 0x89AB_CDEF; // a: the low word
    buf[1] = 0x0123_4567; // b: the high word
    run(body, 1, 0, &mut buf);
    assert_eq!(buf[2], 0x89AB_CDEF ^ 0x0123_4567, "xor.b32");
    assert_eq!(buf[3], 0x0123_4567, "shf.l by 0 is b");
    assert_eq!(
        buf[4], 0x2345_6789,
        "shf.l by 8: b's low 24 bits, then a's top byte"
    );
    assert_eq!(buf[5], 0x1234_5678, "shf.l.wrap by 36 shifts by 4");
}

/// `mul.rn.f16x2` (PTX ISA, half-precision mul): per half, the f16 product rounded to
/// nearest even, subnormals kept: 1 x 256; the smallest subnormal x 256 (2^-16, still
/// subnormal); (1 + 2^-10)^2 = 1 + 2^-9 + 2^-20, which rounds to 1 + 2^-9; 65504 x 2
/// overflows to infinity. sm_80's packed fp8 decode multiplies by 256 with it.
#[test]
fn f16x2_multiply_form() {
    let body = "\tld.global.u32 %r2, [%rd2];\n\tld.global.u32 %r3, [%rd2+4];\n\
        \tld.global.u32 %r4, [%rd2+8];\n\tld.global.u32 %r5, [%rd2+12];\n\
        \tmul.rn.f16x2 %r6, %r2, %r3;\n\tst.global.u32 [%rd2+16], %r6;\n\
        \tmul.rn.f16x2 %r7, %r4, %r5;\n\tst.global.u32 [%rd2+20], %r7;";
    let mut buf = vec![0u32; 6];
    buf[0] = 0x0001_3C00; // (1, 2^-24)
    buf[1] = 0x5C00_5C00; // (256, 256)
    buf[2] = 0x7BFF_3C01; // (1 + 2^-10, 65504)
    buf[3] = 0x4000_3C01; // (1 + 2^-10, 2)
    run(body, 1, 0, &mut buf);
    assert_eq!(buf[4] & 0xFFFF, 0x5C00, "1 x 256");
    assert_eq!(buf[4] >> 16, 0x0100, "2^-24 x 256 = 2^-16, a subnormal");
    assert_eq!(buf[5] & 0xFFFF, 0x3C02, "(1 + 2^-10)^2 rounds to 1 + 2^-9");
    assert_eq!(buf[5] >> 16, 0x7C00, "65504 x 2 overflows to infinity");
}

/// `cp.async` with a src-size operand: 0 reads nothing and zero-fills the 16 bytes
/// (checked in shared memory: the launch traps otherwise), 16 copies them; only the
/// bytes read count as read. Any other src-size is refused.
#[test]
fn cp_async_src_size_zero_fills_without_reading() {
    // Shared words 0..8 start as 0xAAAAAAAA; copy 1 (src-size 0) targets words 0..4,
    // copy 2 (src-size 16) words 4..8 from the buffer.
    let check = |w: u32, want: &str| {
        format!(
            "\tld.shared.u32 %r5, [%rd3+{}];\n\t{want}\n\tsetp.ne.u32 %p1, %r5, %r6;\n\t@%p1 trap;\n",
            4 * w
        )
    };
    let mut body = String::from(
        "\tmov.b32 %r2, -1431655766;\n\
         \tst.shared.v4.u32 [%rd3], {%r2, %r2, %r2, %r2};\n\
         \tst.shared.v4.u32 [%rd3+16], {%r2, %r2, %r2, %r2};\n\
         \tmov.b32 %r3, 0;\n\tmov.b32 %r4, 16;\n\
         \tcp.async.cg.shared.global [%rd3], [%rd2], 16, %r3;\n\
         \tcp.async.cg.shared.global [%rd3+16], [%rd2], 16, %r4;\n\
         \tcp.async.commit_group;\n\tcp.async.wait_group 0;\n",
    );
    for w in 0..4 {
        body += &check(w, "mov.b32 %r6, 0;");
        body += &check(4 + w, &format!("ld.global.u32 %r6, [%rd2+{}];", 4 * w));
    }
    let mut buf = vec![0x1111_1111u32, 0x2222_2222, 0x3333_3333, 0x4444_4444];
    let stats = launch(&body, 1, 64, &mut buf, Access::Read, MathMode::Exact).unwrap();
    assert_eq!(stats.cp_async_bytes, 16, "only the src-size 16 copy reads");
    let bad = body.replace("16, %r3;", "16, 8;");
    let e = launch(&bad, 1, 64, &mut buf, Access::Read, MathMode::Exact).unwrap_err();
    assert!(format!("{e}").contains("src-size 8"), "{e}");
}
