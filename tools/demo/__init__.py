"""`batchpilot demo`: local servers, Prometheus, a load step and the tuner.

One module per job: `options` (what a run is asked to do), `supervisor` (the
processes it starts and stops), `fleet` (the servers as a fleet the replica
rule scales), `exporter` (the policy's SLO gauges), `run` (load and tuner side
by side), `recording` (what each tuner round did), `view` (the live terminal
view and the summary), `plot` (the PNG) and `cli` (the command line and signals).
"""
