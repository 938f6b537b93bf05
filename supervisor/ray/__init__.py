"""tokenpipe on a Ray cluster: replicas of one supervisor each, routed by session.

Importing this package does not import Ray; the modules that need it do (`pip install -e
'.[ray]'`). See ARCHITECTURE.md, "Beyond one machine".
"""
