"""A client of Kyutai's chat protocol for the liveness tests, run as its own process (to be
frozen with SIGSTOP, or cut off in a network namespace):

    python tests/helpers/web_talker.py ws://HOST:PORT/api/chat

It streams a tone at the pace of speech, as Kyutai's clients stream the microphone, reads
what comes back (aiohttp answers the server's pings meanwhile) and prints `talking` once
Moshi's audio arrived.
"""

from __future__ import annotations

import asyncio
import sys

import aiohttp
import numpy as np
import sphn

FRAME = 1920  # 80 ms at 24 kHz


async def talk(url: str) -> None:
    writer = sphn.OpusStreamWriter(24_000)
    t = np.arange(FRAME) / 24_000
    tone = (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)
    async with aiohttp.ClientSession() as session, session.ws_connect(url) as ws:

        async def send() -> None:
            while True:
                page = writer.append_pcm(tone)
                if page:
                    await ws.send_bytes(b"\x01" + page)
                await asyncio.sleep(FRAME / 24_000)

        sending = asyncio.create_task(send())
        said = False
        async for message in ws:
            if not said and message.type == aiohttp.WSMsgType.BINARY and message.data[0] == 1:
                print("talking", flush=True)
                said = True
        sending.cancel()
        print("closed", flush=True)


if __name__ == "__main__":
    asyncio.run(talk(sys.argv[1]))
