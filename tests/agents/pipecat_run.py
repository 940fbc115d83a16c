"""A real Pipecat pipeline (pipecat-ai 1.14, in its own venv: requirements-agents.txt) against a local server:
`.venv-agents/bin/python tests/agents/pipecat_run.py SERVICE URL [--key K] [--voice V] [--text T ...]
[--interrupt-after-bytes N] [--rate R]`. SERVICE is cartesia, elevenlabs or openai. Prints one JSON object: per turn
(context) the audio bytes, the word-timestamp frames (TTSTextFrame: text, pts), started/stopped, and the errors.

Turns: each `--text` is a TTSSpeakFrame, spoken one after the other on the service's one socket. With
`--interrupt-after-bytes N`, an InterruptionFrame (a user's barge-in) is pushed once the first turn has sent N bytes
of audio, then the next turn is spoken."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

from pipecat.frames.frames import (
    EndFrame,
    ErrorFrame,
    Frame,
    InterruptionFrame,
    TTSAudioRawFrame,
    TTSSpeakFrame,
    TTSStartedFrame,
    TTSStoppedFrame,
    TTSTextFrame,
)
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineParams, PipelineWorker
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
from pipecat.workers.runner import WorkerRunner


class Collector(FrameProcessor):
    def __init__(self, t0: float):
        super().__init__()
        self.t0 = t0
        self.turns: dict[str, dict] = {}
        self.order: list[str] = []
        self.errors: list[str] = []
        self.stopped = asyncio.Event()
        self.audio = asyncio.Event()
        self.total = 0

    def turn(self, cid) -> dict:
        cid = str(cid)
        if cid not in self.turns:
            self.order.append(cid)
            self.turns[cid] = {"bytes": 0, "chunks": 0, "words": [], "started": False, "stopped": False,
                               "first_audio_s": None, "sample_rate": None}
        return self.turns[cid]

    async def process_frame(self, frame: Frame, direction: FrameDirection):
        await super().process_frame(frame, direction)
        cid = getattr(frame, "context_id", None)
        if isinstance(frame, TTSAudioRawFrame):
            t = self.turn(cid)
            if t["first_audio_s"] is None:
                t["first_audio_s"] = round(time.perf_counter() - self.t0, 3)
            t["bytes"] += len(frame.audio)
            t["chunks"] += 1
            t["sample_rate"] = frame.sample_rate
            self.total += len(frame.audio)
            self.audio.set()
        elif isinstance(frame, TTSTextFrame):
            self.turn(cid)["words"].append({"text": frame.text, "pts": frame.pts})
        elif isinstance(frame, TTSStartedFrame):
            self.turn(cid)["started"] = True
        elif isinstance(frame, TTSStoppedFrame):
            self.turn(cid)["stopped"] = True
            self.stopped.set()
        elif isinstance(frame, ErrorFrame):
            self.errors.append(str(frame.error))
        await self.push_frame(frame, direction)


def service(name: str, url: str, key: str, voice: str, rate: int):
    if name == "cartesia":
        from pipecat.services.cartesia.tts import CartesiaTTSService

        return CartesiaTTSService(api_key=key, url=url, sample_rate=rate,
                                  settings=CartesiaTTSService.Settings(voice=voice))
    if name == "elevenlabs":
        from pipecat.services.elevenlabs.tts import ElevenLabsTTSService

        return ElevenLabsTTSService(api_key=key, url=url, sample_rate=rate,
                                    settings=ElevenLabsTTSService.Settings(voice=voice))
    from pipecat.services.openai.tts import OpenAITTSService

    return OpenAITTSService(api_key=key, base_url=url, sample_rate=rate,
                            settings=OpenAITTSService.Settings(voice=voice))


async def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("service", choices=("cartesia", "elevenlabs", "openai"))
    ap.add_argument("url")
    ap.add_argument("--key", default="local")
    ap.add_argument("--voice", default="default")
    ap.add_argument("--text", action="append", required=True)
    ap.add_argument("--interrupt-after-bytes", type=int, default=0)
    ap.add_argument("--rate", type=int, default=24000)
    ap.add_argument("--timeout", type=float, default=120.0)
    args = ap.parse_args()

    t0 = time.perf_counter()
    tts = service(args.service, args.url, args.key, args.voice, args.rate)
    sink = Collector(t0)
    task = PipelineWorker(Pipeline([tts, sink]), params=PipelineParams(audio_out_sample_rate=args.rate))
    runner = WorkerRunner(handle_sigint=False)
    await runner.add_workers(task)
    run = asyncio.create_task(runner.run())
    interrupted_at = None
    try:
        for i, text in enumerate(args.text):
            sink.stopped.clear()
            await task.queue_frame(TTSSpeakFrame(text))
            if i == 0 and args.interrupt_after_bytes:
                while sink.total < args.interrupt_after_bytes:
                    await asyncio.wait_for(sink.audio.wait(), args.timeout)
                    sink.audio.clear()
                interrupted_at = sink.total
                await task.queue_frame(InterruptionFrame())
                await asyncio.sleep(1.0)  # what the server sends after the cancel is counted below
                continue
            await asyncio.wait_for(sink.stopped.wait(), args.timeout)
        await asyncio.sleep(0.5)
    finally:
        await task.queue_frame(EndFrame())
        await asyncio.wait_for(run, 30)
    first = sink.order[0] if sink.order else None
    print(json.dumps({"turns": [{"context": c, **sink.turns[c]} for c in sink.order], "errors": sink.errors,
                      "interrupted_at_bytes": interrupted_at,
                      "first_turn_bytes": sink.turns[first]["bytes"] if first else 0}))
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
