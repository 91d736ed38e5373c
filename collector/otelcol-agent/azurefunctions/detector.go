// Package azurefunctions stands in for the upstream detector (see go.mod): it never detects Azure Functions.
package azurefunctions

import (
	"context"

	"go.opentelemetry.io/otel/sdk/resource"
)

// ResourceDetector returns an empty resource, which resourcedetection reads as "not on Azure Functions".
type ResourceDetector struct{}

var _ resource.Detector = (*ResourceDetector)(nil)

// NewResourceDetector has the upstream signature that resourcedetection calls.
func NewResourceDetector() *ResourceDetector { return &ResourceDetector{} }

// Detect reports nothing.
func (*ResourceDetector) Detect(context.Context) (*resource.Resource, error) {
	return resource.Empty(), nil
}
