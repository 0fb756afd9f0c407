"""Floor 0, the control-plane substrate that every dlshare daemon, library and command stands on.

- :mod:`~nodesvc.bus.mqtt`: one resilient MQTT connection (:class:`Bus`: Last Will, reconnect with backoff);
- :mod:`~nodesvc.bus.messages`: topic names and the JSON payload codec (pure, fuzzed);
- :mod:`~nodesvc.bus.rpc`: commands with correlated replies (:class:`Correlator`, :class:`NodeClient`);
- :mod:`~nodesvc.bus.broker`: the embedded amqtt broker for one machine;
- :mod:`~nodesvc.bus.config`: layered TOML/environment/flag configuration;
- :mod:`~nodesvc.bus.logs`: plain or JSON-lines logging;
- :mod:`~nodesvc.bus.procs`: free ports, waiting for ports and conditions, stopping children, addresses;
- :mod:`~nodesvc.bus.text`: Markdown tables, which commands and benchmarks print.

May import: the standard library and its own third-party dependencies (aiomqtt, paho-mqtt,
amqtt). Nothing else of dlshare: every other package may import this one, and the import
contracts in pyproject.toml keep it so.
"""
