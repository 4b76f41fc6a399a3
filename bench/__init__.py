"""What nfab is measured with, kept out of the installed package.

`bench.heldout` holds the user models nfab was never tuned on, `bench.userloop` the one
user-style DDP loop the study trains them in, `bench.study` the study itself (`python -m bench.study`:
every setting x variant in that loop, its JSON and the docs/study.md tables rendered from it),
`bench.runs` folds a benchmark run into its setting's results file. Import them from a repository
checkout (the repository root on `sys.path`: `python -m ...` from the root, or `PYTHONPATH=.`).
`nfab/` never imports them.
"""
