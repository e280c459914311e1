"""The parameter that marks a test variant as needing a GPU, shared by conftest's fixtures and the tests that
parametrise over devices themselves."""
import pytest

# A variant that needs a GPU is a fixture or test parameter named "gpu" carrying this mark, so that
# `pytest -m cuda` (scripts/device_check.sh) selects it and the CPU variants beside it stay unmarked;
# tests/test_cuda_selection.py fails if a device variant is left out of `-m cuda`.
GPU = pytest.param("gpu", marks=pytest.mark.cuda)
