"""What OpenTelemetry's console exporters printed, read back from a process's output."""

import json


def console_json_objects(text: str) -> list:
    """Every JSON object that OpenTelemetry's console exporters printed in `text` (other output is skipped)."""
    decoder = json.JSONDecoder()
    found, index = [], 0
    while True:
        start = text.find("{", index)
        if start < 0:
            return found
        try:
            obj, end = decoder.raw_decode(text, start)
        except json.JSONDecodeError:
            index = start + 1
            continue
        found.append(obj)
        index = end


def console_points(objects: list, name: str) -> list:
    """(attributes, value) of every data point of metric `name` in console-exporter JSON `objects`, in order."""
    found = []
    for obj in objects:
        for rm in obj.get("resource_metrics", []):
            for sm in rm.get("scope_metrics", []):
                for metric in sm.get("metrics", []):
                    if metric["name"] == name:
                        found += [(p.get("attributes", {}), p.get("value")) for p in metric["data"]["data_points"]]
    return found
