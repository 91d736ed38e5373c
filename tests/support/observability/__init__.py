"""The observability tests' parts and workloads: Prometheus, Phoenix, node + @grafana/schema (`parts`), the
Collector's metric names and exposition (`promnames`, `exposition`), and the transfer workloads they watch, run as
scripts in namespaces of their own (`workload`, `peers`, `links`)."""
