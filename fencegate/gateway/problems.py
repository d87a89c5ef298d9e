"""Kept so that ``from fencegate.gateway.problems import Problem`` still works: the problem
answers live in `fencegate.problems`, below the gateway, the console and the signatures."""

from fencegate.problems import PROBLEM_CONTENT_TYPE, PROBLEM_TYPE_BASE, Problem

__all__ = ["PROBLEM_CONTENT_TYPE", "PROBLEM_TYPE_BASE", "Problem"]
