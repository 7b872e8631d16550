//! The embedded PTX matches the kernels: every `Kernel::NAME` is an entry point of
//! every module, and the modules are the architectures docs/kernels.md promises.

use pagedkv::kernels::kernels::{
    CopyBlocks, DecodeReduce, KvAppend, PagedDecode, PagedPrefill, PagedPrefillSimt,
};
use pagedkv::kernels::{Bf16, E4m3, E5m2, F16, Kernel};
use pagedkv::ptx;

fn names() -> Vec<&'static str> {
    macro_rules! typed {
        ($t:ty) => {
            [
                <KvAppend<$t> as Kernel>::NAME,
                <PagedDecode<$t, false> as Kernel>::NAME,
                <PagedDecode<$t, true> as Kernel>::NAME,
                <DecodeReduce<$t> as Kernel>::NAME,
            ]
        };
    }
    let mut v = vec![<CopyBlocks as Kernel>::NAME];
    v.extend(typed!(F16));
    v.extend(typed!(Bf16));
    v.extend(typed!(f32));
    v.extend([
        <PagedPrefill<F16> as Kernel>::NAME,
        <PagedPrefill<Bf16> as Kernel>::NAME,
        <PagedPrefillSimt<f32> as Kernel>::NAME,
    ]);
    // fp8 caches under f16 / bf16 queries.
    macro_rules! fp8 {
        ($t:ty, $k:ty) => {
            [
                <KvAppend<$t, $k> as Kernel>::NAME,
                <PagedDecode<$t, false, $k> as Kernel>::NAME,
                <PagedDecode<$t, true, $k> as Kernel>::NAME,
                <PagedPrefill<$t, $k> as Kernel>::NAME,
            ]
        };
    }
    v.extend(fp8!(F16, E4m3));
    v.extend(fp8!(F16, E5m2));
    v.extend(fp8!(Bf16, E4m3));
    v.extend(fp8!(Bf16, E5m2));
    v
}

#[test]
fn every_kernel_is_an_entry_point_of_every_module() {
    let archs: Vec<_> = ptx::ALL.iter().map(|m| m.arch).collect();
    assert_eq!(archs, ["sm_80", "sm_90"]);
    for m in ptx::ALL {
        assert!(m.ptx.contains(&format!(".target {}", m.arch)));
        let mut want = names();
        want.sort();
        let mut got = m.entry_points.to_vec();
        got.sort();
        assert_eq!(got, want, "{}", m.arch);
    }
}

#[test]
fn the_newest_module_a_device_can_run_is_chosen() {
    assert_eq!(ptx::for_compute_capability(7, 5), None);
    assert_eq!(ptx::for_compute_capability(8, 0).unwrap().arch, "sm_80");
    assert_eq!(ptx::for_compute_capability(8, 9).unwrap().arch, "sm_80");
    assert_eq!(ptx::for_compute_capability(9, 0).unwrap().arch, "sm_90");
    assert_eq!(ptx::for_compute_capability(12, 0).unwrap().arch, "sm_90");
}

#[test]
fn hot_loads_are_global_and_sixteen_bytes_wide() {
    for m in ptx::ALL {
        // K and V are read through the non-coherent global path, 16 bytes at a time.
        assert!(m.ptx.contains("ld.global.nc.v4.u32"), "{}", m.arch);
        assert!(m.ptx.contains("st.global.v4.u32"), "{}", m.arch);
        // No local memory anywhere (no spilled arrays).
        assert!(
            !m.ptx.contains(".local"),
            "{}: local memory in the PTX",
            m.arch
        );
    }
}

/// The text of entry point `name` in `ptx` (up to the next entry).
fn entry_body<'a>(ptx: &'a str, name: &str) -> &'a str {
    let start = ptx
        .find(&format!(".entry {name}("))
        .unwrap_or_else(|| panic!("no entry {name}"));
    let rest = &ptx[start + 1..];
    let end = rest.find(".entry ").map_or(rest.len(), |e| e);
    &rest[..end]
}

#[test]
fn decode_streams_k_and_v_through_the_cp_async_pipeline() {
    for m in ptx::ALL {
        for t in ["f16", "bf16", "f32"] {
            for name in [
                format!("paged_decode_attention_{t}"),
                format!("paged_decode_attention_split_{t}"),
            ] {
                let body = entry_body(m.ptx, &name);
                for want in [
                    "cp.async.cg.shared.global",
                    "cp.async.commit_group",
                    "cp.async.wait_group 3",
                    "ld.shared.v4.u32",
                    "fma.rn.f32",
                    "ex2.approx.ftz.f32",
                ] {
                    assert!(body.contains(want), "{} {name}: no `{want}`", m.arch);
                }
                // K and V come only through cp.async: no 16-byte global load is left.
                assert!(
                    !body.contains("ld.global.nc.v4"),
                    "{} {name}: K/V read with a plain global load",
                    m.arch
                );
            }
        }
    }
}

#[test]
fn prefill_runs_on_tensor_cores_with_k_and_v_through_cp_async() {
    for m in ptx::ALL {
        for t in ["f16", "bf16"] {
            let name = format!("paged_prefill_attention_{t}");
            let body = entry_body(m.ptx, &name);
            for want in [
                format!("mma.sync.aligned.m16n8k16.row.col.f32.{t}.{t}.f32"),
                "ldmatrix.sync.aligned.m8n8.x4.shared.b16".into(),
                "ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16".into(),
                "cp.async.cg.shared.global".into(),
                "ex2.approx.ftz.f32".into(),
            ] {
                assert!(body.contains(&want), "{} {name}: no `{want}`", m.arch);
            }
        }
    }
}

#[test]
fn the_planners_register_count_bounds_every_decode_kernel() {
    use pagedkv::host::ops::attention::{DECODE_REGISTERS, DECODE_REGISTERS_FP8};
    let report = include_str!("../../ptx/resources.md");
    // The ptxas table comes first; the SASS and occupancy tables follow it.
    let ptxas = report.split("\n## ").next().unwrap();
    let mut seen = 0;
    for line in ptxas
        .lines()
        .filter(|l| l.contains("paged_decode_attention"))
    {
        let cols: Vec<&str> = line.split('|').map(str::trim).collect();
        let regs: u32 = cols[3].parse().unwrap();
        let fp8 = cols[2].ends_with("_e4m3") || cols[2].ends_with("_e5m2");
        let bound = if fp8 {
            DECODE_REGISTERS_FP8
        } else {
            DECODE_REGISTERS
        };
        assert!(
            regs <= bound,
            "{} {}: {regs} registers > the planner's bound {bound}: occupancy would be overestimated",
            cols[1],
            cols[2]
        );
        seen += 1;
    }
    assert_eq!(seen, 28, "decode rows in ptx/resources.md");
}
