"""Helpers the tests share: file writers, the CLI run in-process, our own K-quantizer, the mutants."""
