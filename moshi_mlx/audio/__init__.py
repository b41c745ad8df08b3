"""Sound devices, lock-free frame queues, the real-time loop, audio files and resampling.

`SAMPLE_RATE` and `FRAME_SIZE` are Mimi's: every audio path of the package runs at 24 kHz in
frames of 80 ms, one model step each."""

SAMPLE_RATE = 24_000
FRAME_SIZE = 1920  # samples per 80 ms frame
