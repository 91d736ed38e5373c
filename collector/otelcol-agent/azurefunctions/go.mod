// Stand-in for go.opentelemetry.io/contrib/detectors/azure/azurefunctions, which the module proxy refuses (403 at
// v0.18.0, its first release); resourcedetection imports it for its `azurefunctions` detector, which the agent
// config does not enable. Its detector finds nothing: on Azure Functions, use a Collector from the releases.
module go.opentelemetry.io/contrib/detectors/azure/azurefunctions

go 1.25

require go.opentelemetry.io/otel/sdk v1.46.0
