"""Tools around the Lynx library, not part of a server's runtime: start servers and a
router for tests, demos and benchmarks (:mod:`lynx.tools.cluster`), put prefill and decode
on the two sides of a rate-limited link (:mod:`lynx.tools.netlink`), the demo itself
(:mod:`lynx.tools.demo`), and the models it runs (:mod:`lynx.tools.models`)."""
