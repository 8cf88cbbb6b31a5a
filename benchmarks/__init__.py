"""GPU benchmarks of every mm3lab kernel against baselines measured in the same run.

Run on a CUDA machine from the repository root::

    python3 -m benchmarks            # every suite (time budget 480 s), writes benchmarks/results/<gpu>.json
    python3 -m benchmarks --quick    # one shape per suite
    python3 -m benchmarks --only attention_decode msa_decode --budget 300

A run of some suites (``--only``) adds its records to the results file, replacing
only those suites' earlier records (``--fresh`` starts the file over); the file is
saved after every suite. ``--budget`` seconds are shared among the run's suites by
weight: a suite past its share starts no new shape and notes what it skipped.
``--merge A.json B.json --out C.json`` joins results files without a GPU.
``--dry-run`` runs every suite's code on the CPU with tiny shapes.
"""
