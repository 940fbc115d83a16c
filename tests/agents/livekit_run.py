"""LiveKit Agents' own Cartesia plugin (livekit-plugins-cartesia 1.8.9, in the agents venv: requirements-agents.txt)
against a local server: `.venv-agents/bin/python tests/agents/livekit_run.py MODE BASE_URL --key K [--voice V]
[--rate R] --text T [--text T ...] [--close-after-frames N] [--save PREFIX]`. Prints one JSON object.

MODE `synthesize`: `TTS.synthesize(text)` for each text (Cartesia's `POST /tts/bytes`); MODE `stream`: one
`TTS.stream()` fed every text then ended (Cartesia's `/tts/websocket`, word timestamps on, as the plugin's default).
Per utterance: the audio's bytes, frames, sample rate and sha256, the time to its first frame, and the timed words
(`TimedString`s the plugin puts on the frames for LiveKit's aligned transcripts: text, start, end in seconds). With
`--close-after-frames N` the stream is closed once N frames came (what an agent does when the user barges in),
then the script prints `held` on stderr and keeps the plugin (and its pooled socket) open until a line (or the end)
comes on its stdin, so the caller can look at the server meanwhile."""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import sys
import time

import aiohttp
from livekit.agents.types import USERDATA_TIMED_TRANSCRIPT
from livekit.plugins import cartesia


def utterance() -> dict:
    return {"bytes": 0, "frames": 0, "sample_rate": None, "first_audio_s": None, "words": [], "sha256": None,
            "_hash": hashlib.sha256(), "_audio": bytearray()}


def take(out: dict, frame, t0: float) -> None:
    """One audio frame of the plugin's stream into `out`: its PCM, its rate, the timed words it carries."""
    data = bytes(frame.data.cast("B")) if isinstance(frame.data, memoryview) else bytes(frame.data)
    if out["first_audio_s"] is None:
        out["first_audio_s"] = round(time.perf_counter() - t0, 3)
    out["bytes"] += len(data)
    out["frames"] += 1
    out["sample_rate"] = frame.sample_rate
    out["_hash"].update(data)
    out["_audio"] += data
    for w in frame.userdata.get(USERDATA_TIMED_TRANSCRIPT, []) or []:
        out["words"].append({"text": str(w), "start": getattr(w, "start_time", None),
                             "end": getattr(w, "end_time", None)})


def done(out: dict, save: str | None, n: int) -> dict:
    out["sha256"] = out.pop("_hash").hexdigest()
    audio = out.pop("_audio")
    if save:
        with open(f"{save}.{n}.pcm", "wb") as f:
            f.write(audio)
    return out


async def run(args) -> dict:
    result: dict = {"utterances": [], "errors": []}
    async with aiohttp.ClientSession() as http:
        tts = cartesia.TTS(api_key=args.key, base_url=args.base_url, voice=args.voice, sample_rate=args.rate,
                           http_session=http)
        try:
            if args.mode == "synthesize":
                for text in args.text:
                    out, t0 = utterance(), time.perf_counter()
                    async with tts.synthesize(text) as stream:
                        async for ev in stream:
                            take(out, ev.frame, t0)
                    result["utterances"].append(done(out, args.save, len(result["utterances"])))
            else:
                out, t0 = utterance(), time.perf_counter()
                stream = tts.stream()
                for text in args.text:
                    stream.push_text(text + " ")
                stream.end_input()
                async for ev in stream:
                    take(out, ev.frame, t0)
                    if args.close_after_frames and out["frames"] >= args.close_after_frames:
                        break
                await stream.aclose()
                result["utterances"].append(done(out, args.save, 0))
                if args.close_after_frames:
                    print("held", file=sys.stderr, flush=True)
                    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        except Exception as e:  # noqa: BLE001 - the plugin's error is the result
            result["errors"].append(f"{type(e).__name__}: {e}")
        finally:
            await tts.aclose()
    return result


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["synthesize", "stream"])
    ap.add_argument("base_url")
    ap.add_argument("--key", required=True)
    ap.add_argument("--voice", default="default")
    ap.add_argument("--rate", type=int, default=24000)
    ap.add_argument("--text", action="append", required=True)
    ap.add_argument("--close-after-frames", type=int, default=0)
    ap.add_argument("--save", help="write each utterance's audio as it came to SAVE.N.pcm")
    args = ap.parse_args()
    print(json.dumps(asyncio.run(run(args))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
