"""The `web` part: `python -m moshi_mlx web`'s own work per 80 ms frame, the model
aside: decoding the client's Ogg Opus, encoding Moshi's frame, and a websocket round trip of
the two audio messages on localhost (target <= 5 ms)."""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from bench_stats import summarize

from ..part import Part, backend_dtype_label


def _voiced_frames(count: int, seed: int) -> np.ndarray:
    """Speech-like audio (harmonics of a gliding pitch, syllable-rate envelope, a little
    noise): what the server's Opus codec sees. White noise costs the encoder up to 4x more."""
    t = np.arange(count * 1920) / 24_000
    pitch = 140 + 30 * np.sin(2 * np.pi * 0.7 * t)
    phase = 2 * np.pi * np.cumsum(pitch) / 24_000
    voice = sum(np.sin(k * phase) / k for k in range(1, 12))
    envelope = 0.5 + 0.5 * np.sin(2 * np.pi * 4 * t) ** 2
    noise = np.random.default_rng(seed).standard_normal(len(t))
    pcm = 0.1 * voice * envelope + 0.005 * noise
    return pcm.astype(np.float32).reshape(count, 1920)


def bench_web(frames: int, warmup: int, seed: int) -> dict:
    """ms per 80 ms frame that the web server spends besides the model step."""
    import asyncio

    import aiohttp
    import sphn
    from aiohttp import web

    from moshi_mlx.serve.chat.opus import OpusFrameReader, OpusFrameWriter

    pcm = _voiced_frames(warmup + frames, seed)
    client_writer = sphn.OpusStreamWriter(24_000)
    client_pages = [client_writer.append_pcm(frame) for frame in pcm]  # the mic's 80 ms
    reader, writer = OpusFrameReader(24_000, 1920), OpusFrameWriter(24_000)
    decode, encode, replies = [], [], []
    for pages, reply in zip(client_pages, pcm[::-1]):
        t0 = time.perf_counter()
        reader.feed(pages)
        t1 = time.perf_counter()
        replies.append(writer.encode(reply))
        decode.append(t1 - t0)
        encode.append(time.perf_counter() - t1)

    async def echo(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        index = 0
        async for _message in ws:  # each client message answered by Moshi's pages
            await ws.send_bytes(b"\x01" + replies[index])
            index += 1
        return ws

    async def round_trips() -> list[float]:
        app = web.Application()
        app.router.add_get("/api/chat", echo)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        times = []
        chat = f"ws://127.0.0.1:{port}/api/chat"
        async with aiohttp.ClientSession() as session, session.ws_connect(chat) as ws:
            for pages in client_pages:
                t0 = time.perf_counter()
                await ws.send_bytes(b"\x01" + pages)
                await ws.receive()
                times.append(time.perf_counter() - t0)
        await runner.cleanup()
        return times

    websocket = asyncio.run(round_trips())
    total = [d + e + w for d, e, w in zip(decode, encode, websocket)]
    return {
        "impl": "ours",
        "backend": "sphn+aiohttp",
        "decode_ms": summarize(decode[warmup:]),
        "encode_ms": summarize(encode[warmup:]),
        "websocket_ms": summarize(websocket[warmup:]),
        "overhead_ms": summarize(total[warmup:]),
        "client_bytes_per_frame": float(np.mean([len(p) for p in client_pages[warmup:]])),
        "reply_bytes_per_frame": float(np.mean([len(r) for r in replies[warmup:]])),
    }


def cases(args: argparse.Namespace, folder: Path) -> Iterator[dict]:
    """One case, over at least 10 frames."""
    yield {"part": "web", "ours": bench_web(max(args.frames, 10), args.warmup, args.seed)}


PART = Part(
    "web",
    cases,
    metrics=lambda case: ("decode_ms", "encode_ms", "websocket_ms", "overhead_ms"),
    label=backend_dtype_label,
)
