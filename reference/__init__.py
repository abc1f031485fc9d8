"""moelab.reference: pure-PyTorch ground truth for every op in SPEC.md (filled in at integration)."""
