//! Nothing but the tests in `tests/`: the `#[idempotent]` macro's compile errors (one file per
//! misuse, with its expected `.stderr`) and the handler shapes that must compile, run by
//! trybuild with only the dependencies the cases use.
