"""What the tests share, by job (conftest.py holds only pytest's hooks; tests and workers import
these modules):

- `launch`: launching real training processes, tool scripts and the workers under tests/workers/
  (one spec format), `run_distributed` (one function on N gloo ranks), and the workers' side of it;
- `tolerances`: the tolerances of the numerical proofs and the checks built on them;
- `standins`: stand-ins for torchft's Manager, in-process;
- `inputs`: the standard small run (TINY) and test data;
- `machine`: what this machine can run (a C++ compiler, rowwise fp8 scales);
- `hf`: the tiny Hugging Face models the hf tests export (conftest.py's `hf` fixture);
- `tiers`: the test tiers each module declares, checked against what it launches.
"""
