"""The precision environment a probe runs in: CUDA's autocast policy on the CPU, the FP32 baseline's guards,
the runtime overrides a fix applies, and the recording GradScaler."""
