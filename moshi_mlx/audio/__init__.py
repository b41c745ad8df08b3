"""Sound devices, lock-free frame rings, the real-time loop, audio files and resampling."""
