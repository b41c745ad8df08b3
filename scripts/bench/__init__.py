"""Speed of moshi_mlx's streaming loop on random weights, optionally beside Kyutai's moshi_mlx.

    python scripts/bench.py                                  # tiny + 1B, bf16 + q4, default parts
    python scripts/bench.py --shapes tiny --quant bf16,q8,q4 --parts lm --steps 100
    python scripts/bench.py --shapes tiny,1b --quant bf16,q4 --kyutai --json bench.json
    python scripts/bench.py --parts tts --shapes tts-small --steps 20 --kyutai --rounds 2
    python scripts/bench.py --suite gpu -o gpu.json          # every figure that needs a GPU
    python scripts/bench.py --floor                          # the 7B bandwidth floor table

(`python scripts/bench ...` is the same.) One file per part in `parts/`, each registered in
`parts.PARTS` as a `Part` (how its cases run, how the table shows them), measured in that
order: `lm` (ms per LM step and its split), `mimi` (ms per streaming frame per codec
backend), `pipeline` (encode + LM step + decode per frame), `echo` (the live app's echo
canceller per frame), `kv` and `kv-fidelity` (quantized KV caches: memory and speed, logit
fidelity), `stt` (speech-to-text batching), `persona` (PersonaPlex's prompt phase, cached
starts and step), `tts` (text-to-speech first audio and real-time factor), `web` (the web
server's own work per frame). Each part's module docstring says what it measures.

Peak memory is MLX's (`mx.get_peak_memory`), reset before every case. Percentiles are over
the measured steps, after `--warmup` steps. Weights are random, written in the published
formats into `--weights-dir` (default: a temporary folder) by `moshi_mlx.testing`'s writers
(`weights.py`), never fetched. With `--kyutai`, every LM case, the MLX Mimi case and the TTS
cases also run Kyutai's `moshi_mlx` 0.3.0 (`scripts/bench_kyutai.py` in `--kyutai-python`'s
environment) on the same files, alternating with ours, and the table shows the ratio ours /
theirs. `--suite gpu` (`suite.py`) runs the figures that need a GPU on the published shapes
into one JSON file.
"""
