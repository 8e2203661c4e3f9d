//! The conformance suite on every backend: one line each.

inbox_tests::conformance!(postgres, inbox_tests::backends::Postgres);
inbox_tests::conformance!(mariadb, inbox_tests::backends::MySql);
inbox_tests::conformance!(sqlite, inbox_tests::backends::Sqlite);
