"""The bench CLI: decode-step comparisons, memory model, reports and plots."""
