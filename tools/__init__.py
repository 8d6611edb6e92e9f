"""batchpilot's tools: the demo, the load generator, the tuning simulator and a
local Prometheus. They drive the server and the operator from outside and may
import both; neither imports them."""
