"""strata's inference engine: model, loader, backends, batching, K/V."""
from engine.cpu_vector_width import prefer_full_vector_width

prefer_full_vector_width()
