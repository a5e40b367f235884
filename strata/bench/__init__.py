"""`strata bench ...` workloads. Each writes JSON under bench/results/ and prints a table."""
