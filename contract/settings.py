"""The settings a device needs for one run, as one typed record: the server builds it from the run's config,
every message carries it (a few hundred bytes of JSON), the device parses it once per run."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ClientJob:
    run: str
    dataset: str
    data_dir: str
    partition: str
    seed: int
    rounds: int
    local_steps: int
    batch_size: int
    lr: float
    momentum: float
    lr_schedule: str
    delay: int  # DGA's D (0: FedAvg)
    correction: bool
    codec: str

    def as_dict(self) -> dict[str, Any]:
        """Keys as users write them (``local-steps``)."""
        return {key.replace("_", "-"): value for key, value in dataclasses.asdict(self).items()}

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ClientJob:
        """Raises ValueError for anything but exactly this record's keys with values of its types."""
        raw = json.loads(text)
        if not isinstance(raw, dict):
            raise ValueError("the job is not a JSON object")
        values = {key.replace("-", "_"): value for key, value in raw.items()}
        fields = {f.name: f.type for f in dataclasses.fields(cls)}
        if set(values) != set(fields):
            raise ValueError(f"the job's keys {sorted(values)} are not {sorted(fields)}")
        for name, kind in fields.items():
            value = values[name]
            ok = {"str": isinstance(value, str), "bool": isinstance(value, bool)}.get(
                kind, isinstance(value, int | float) and not isinstance(value, bool)
            )
            if not ok or (kind == "int" and not float(value).is_integer()):
                raise ValueError(f"the job's {name.replace('_', '-')} is {value!r}, not a {kind}")
        return cls(**{k: int(v) if fields[k] == "int" else v for k, v in values.items()})
