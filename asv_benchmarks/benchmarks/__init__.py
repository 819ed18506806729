"""sklearn_pathkernel's asv benchmark suite (see doc/contributing.rst, "Benchmarks")."""
