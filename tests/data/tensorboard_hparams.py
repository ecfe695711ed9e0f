"""Prints the hyperparameters TensorBoard's HParams dashboard reads from a
run's TensorBoard folder: the `hparams` plugin's session start info, decoded
with TensorBoard's own reader (`EventAccumulator`) and protobuf
(`plugin_data_pb2`), as one JSON object {name: value}.

    python3 tests/data/tensorboard_hparams.py RUN/tensorboard

Exits 1 if the folder holds no session, or more than one.
"""

import json
import sys

from google.protobuf import json_format
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import plugin_data_pb2

accumulator = EventAccumulator(sys.argv[1])
accumulator.Reload()
content = accumulator.PluginTagToContent("hparams")
if list(content) != ["_hparams_/session_start_info"]:
    print(f"expected one session start info, found tags {list(content)}", file=sys.stderr)
    sys.exit(1)
data = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"])
hparams = {name: json_format.MessageToDict(value) for name, value in data.session_start_info.hparams.items()}
print(json.dumps(hparams, sort_keys=True))
