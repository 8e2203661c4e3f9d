//! The macro's compile errors (one file per misuse, with its expected `.stderr`) and the handler
//! shapes that must compile. Regenerate the `.stderr` files with `TRYBUILD=overwrite` after
//! reviewing a deliberate change.

#[test]
fn ui() {
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/ui/fail/*.rs");
    t.pass("tests/ui/pass/*.rs");
}
