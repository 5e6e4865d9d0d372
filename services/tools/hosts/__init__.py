"""Halfmoon on several hosts made of network namespaces on this machine (root).

topology.py says which host runs what at which address (pure), netns.py makes the hosts
and their faults with iproute2, relay.py lets them reach a database on the machine's
loopback, cluster.py starts the services on their hosts, run.py runs them, faults.py,
throttle.py and chaos.py are `halfmoon cluster chaos`, cli.py is the command.
docs/deploy.md, section 12.
"""
