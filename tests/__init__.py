"""ftshims tests: a package, so that test helpers (shimcheck, fakes, noop_shims) are imported as tests.*."""
