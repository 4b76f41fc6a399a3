"""What nfab is measured with, kept out of the installed package.

`bench.heldout` holds the user models nfab was never tuned on, `bench.userloop` the one
user-style DDP loop the study trains them in, `bench.runs` folds a benchmark run into its
setting's results file. Import them from a repository checkout (the repository root on
`sys.path`: `python -m ...` from the root, or `PYTHONPATH=.`); `nfab bench study` does so itself.
"""
