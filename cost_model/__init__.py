"""Analytic cost model: roofline compute, alpha-beta communication, memory per rank."""
