"""Model families on one set of layers."""
