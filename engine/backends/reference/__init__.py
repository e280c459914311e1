"""The numpy reference backend: every op of the Backend protocol (engine/backends/base.py) in float32 numpy.

Every kernel, CPU and CUDA, is checked against these ops; `--backend numpy --cpu-weights f32` serves with them.
"""
