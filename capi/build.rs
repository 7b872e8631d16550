//! With the `header-check` feature: runs bindgen on `include/pagedkv.h` twice, into
//! `$OUT_DIR/c_types.rs` (the header's structs and enums, as C declares them) and
//! `$OUT_DIR/c_fns.rs` (its functions, typed with the Rust definitions of the same
//! names), for the compile-time checks in `src/header_check.rs`. Without the feature it
//! does nothing (bindgen needs libclang, which a fresh machine lacks).

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rerun-if-changed=include/pagedkv.h");
    // The C test compiles its program for the same target with the `cc` crate.
    for k in ["TARGET", "HOST", "PROFILE"] {
        println!(
            "cargo::rustc-env=PAGEDKV_BUILD_{k}={}",
            std::env::var(k).unwrap_or_default()
        );
    }
    #[cfg(feature = "header-check")]
    generate();
}

#[cfg(feature = "header-check")]
fn generate() {
    use std::path::PathBuf;
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
    let header = "include/pagedkv.h";
    bindgen::Builder::default()
        .header(header)
        .allowlist_type("pagedkv_.*")
        .blocklist_function(".*")
        .default_enum_style(bindgen::EnumVariation::Rust {
            non_exhaustive: false,
        })
        .layout_tests(false)
        .generate()
        .expect("bindgen: types of include/pagedkv.h")
        .write_to_file(out.join("c_types.rs"))
        .expect("write c_types.rs");
    bindgen::Builder::default()
        .header(header)
        .allowlist_function("pagedkv_.*")
        .blocklist_type("pagedkv_.*")
        .raw_line("#[allow(unused_imports)] use crate::*;")
        .layout_tests(false)
        .generate()
        .expect("bindgen: functions of include/pagedkv.h")
        .write_to_file(out.join("c_fns.rs"))
        .expect("write c_fns.rs");
}
