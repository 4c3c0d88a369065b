"""The precision runs of a replayed step: the model rebuilt from a snapshot, the precisions, one run under the op recorder."""
