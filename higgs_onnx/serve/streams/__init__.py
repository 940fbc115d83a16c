"""The text-in stream doors on one engine (`engine.py`): each protocol is a codec that parses its messages into
open / feed / flush / cancel and words the engine's events (`speech.py`: the OpenAI-style WebSocket, `wyoming.py`,
`cartesia.py`, `elevenlabs.py`; `agent.py`: what the vendor sockets share). docs/agents.md "One engine" sketches a
new door."""


def codec_of(door: str | None):
    """The codec of a stream door by its name (`metrics.door_of`): the OpenAI-style WebSocket for any other."""
    from .cartesia import Cartesia
    from .elevenlabs import ElevenLabs
    from .speech import SpeechSocket

    return {"cartesia": Cartesia, "elevenlabs": ElevenLabs}.get(door or "", SpeechSocket)
