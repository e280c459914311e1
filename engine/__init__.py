"""strata's inference engine: model, loader, backends, batching, K/V."""
from engine.cpu_threads import stop_blas_spinning
from engine.cpu_vector_width import prefer_full_vector_width

prefer_full_vector_width()
stop_blas_spinning()
