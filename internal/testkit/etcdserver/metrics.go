package etcdserver

import (
	"bufio"
	"context"
	"fmt"
	"net/http"
	"strconv"
	"strings"
)

// Metrics reads the Prometheus text that the member at clientURL serves on
// /metrics: each series' value by its name as the member prints it, labels
// included (`grpc_server_msg_received_total{grpc_method="Txn",...}`, or
// `process_cpu_seconds_total` alone). hc nil is http.DefaultClient.
func Metrics(ctx context.Context, hc *http.Client, clientURL string) (map[string]float64, error) {
	if hc == nil {
		hc = http.DefaultClient
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, strings.TrimRight(clientURL, "/")+"/metrics", nil)
	if err != nil {
		return nil, err
	}
	resp, err := hc.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("%s/metrics: %s", clientURL, resp.Status)
	}
	series := map[string]float64{}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 64*1024), 1024*1024)
	for sc.Scan() {
		line := sc.Text()
		if line == "" || line[0] == '#' {
			continue
		}
		at := strings.LastIndexByte(line, ' ')
		if at < 0 {
			return nil, fmt.Errorf("%s/metrics: a line without a value: %q", clientURL, line)
		}
		v, err := strconv.ParseFloat(line[at+1:], 64)
		if err != nil {
			return nil, fmt.Errorf("%s/metrics: %q: %w", clientURL, line, err)
		}
		series[line[:at]] = v
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("%s/metrics: %w", clientURL, err)
	}
	return series, nil
}

// MetricName is the name of a series read by [Metrics], without its
// labels.
func MetricName(series string) string {
	name, _, _ := strings.Cut(series, "{")
	return name
}
