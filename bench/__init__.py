"""The lab: benchmarks, tuners and profilers of grpo_lce and its trainers, apart from the product.

Run each from the repository root as a module, e.g. `python -m bench.head --quick --device cpu`;
`bench/README.md` lists them, with the commands that produced the results in `bench/results/`.
"""
