"""The native routes: a DP change and a same-DP restart, read straight from the saved rank files. Import nothing
of the universal route."""
