"""The job's options (higgs_onnx/job/options.py): an error carries the field it is about, as given, never a field
read back from the message text (a bad top_p was reported as param "temperature" in a corpus row)."""

from __future__ import annotations

import pytest

from higgs_onnx.job.options import OptionError, SpeechOptions

CASES = [({"top_p": "x"}, "top_p", "must be a finite number"), ({"top_p": 2}, "top_p", "must be in (0, 1]"),
         ({"temperature": 0.5, "top_p": True}, "top_p", "must be a finite number"),
         ({"temperature": -1}, "temperature", "finite number >= 0"), ({"top_k": -1}, "top_k", ">= 0"),
         ({"seed": 1.5}, "seed", "must be a whole number"), ({"max_rows": 0}, "max_rows", ">= 1")]


@pytest.mark.parametrize("values, param, words", CASES, ids=[next(iter(c[0].items()))[0] + str(i)
                                                             for i, c in enumerate(CASES)])
@pytest.mark.parametrize("door", ["cli", "http", "websocket", "corpus"])
def test_a_sampling_error_names_its_own_field_at_every_door(values, param, words, door):
    with pytest.raises(OptionError) as e:
        SpeechOptions.build(values, door)
    label = "--" + param.replace("_", "-") if door == "cli" else param
    assert e.value.param == param and words in e.value.message and e.value.message.startswith(label), e.value
