"""The rule: one predictive sizing step a round, with a fixed table as its fallback.

One job per module: `window` (the window's derived quantities, computed once),
`step_model` (the step time fitted online), `predictor` (a candidate's p99s and
attainment), `choice` (the cheapest eligible candidate), `fallback` (the table
stepped by until a fit is trusted), `replicas` (when the fleet moves to the pods
needed), `mode` (`mode: auto`), `memory` (the rule's memory, one writer), `reasons`
(the wording) and `round` (`decide`, the one function that gives the knobs, the
replica count and the mode).
docs/tuning.md describes the rule.
"""
