#!/usr/bin/env bash
# Fetch Apache Kafka's broker and tool jars from Maven Central, once, into the
# ignored cache folder. Later runs find the marker file and return at once; the
# marker holds the POM's checksum, so a changed dependency list fetches again.
set -euo pipefail
source "$(dirname "$0")/env.sh"

POM=$ROOT/compose/local/kafka-pom.xml
WANTED=$(sha256sum "$POM" | cut -d' ' -f1)
if [ "$(cat "$KAFKA_LIBS/.complete" 2>/dev/null)" = "$WANTED" ]; then
  exit 0
fi
command -v java >/dev/null || die "java is not on PATH; Conveyor's local broker needs Java 17 (or use Docker: compose/docker-compose.yml)"
command -v mvn >/dev/null || die "mvn is not on PATH; Maven fetches Kafka $KAFKA_VERSION's jars (or use Docker: compose/docker-compose.yml)"
log "fetching Apache Kafka $KAFKA_VERSION jars from Maven Central into $KAFKA_LIBS"
rm -rf "$KAFKA_LIBS"
mkdir -p "$KAFKA_LIBS"
mvn -B -q -f "$POM" \
  -Dkafka.version="$KAFKA_VERSION" \
  dependency:copy-dependencies -DincludeScope=runtime -DoutputDirectory="$KAFKA_LIBS" \
  || die "Maven could not fetch Kafka $KAFKA_VERSION (see the output above)"
echo "$WANTED" >"$KAFKA_LIBS/.complete"
