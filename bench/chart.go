package main

import (
	"fmt"
	"image/color"
	"math"
	"strings"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
)

const chartFile = "pg-throughput.png"

var chartColors = map[string]color.RGBA{
	"raw":              {0, 0, 0, 255},
	"raw-async":        {23, 190, 207, 255},
	"backend-durable":  {140, 86, 75, 255},
	"backend":          {214, 39, 40, 255},
	"backend-nonotify": {255, 127, 14, 255},
	"client":           {148, 103, 189, 255},
	"pglock":           {31, 119, 180, 255},
	"advisory":         {44, 160, 44, 255},
	"floor":            {170, 170, 170, 255},
}

// chart draws PostgreSQL pairs/s against goroutines, both on log scales.
func (r *Report) chart(path string) error {
	gs := r.concs("pg")
	if len(gs) == 0 {
		return nil
	}
	p := plot.New()
	p.Title.Text = fmt.Sprintf("PostgreSQL %s (fsync on), acquire + release pairs/s, %d CPUs", strings.Fields(r.Env.PGVersion + " ?")[0], r.Env.CPUs)
	p.X.Label.Text = "goroutines"
	p.Y.Label.Text = "pairs/s (log scale)"
	p.X.Scale = plot.LogScale{}
	p.Y.Scale = plot.LogScale{}
	var xt []plot.Tick
	for _, g := range gs {
		xt = append(xt, plot.Tick{Value: float64(g), Label: fmt.Sprint(g)})
	}
	p.X.Tick.Marker = plot.ConstantTicks(xt)
	p.X.Min, p.X.Max = float64(gs[0])/1.3, float64(gs[len(gs)-1])*1.3
	lo, hi := math.Inf(1), math.Inf(-1)
	for i, c := range []string{"floor", "advisory", "raw", "raw-async", "backend", "backend-durable", "backend-nonotify", "client", "pglock"} {
		var pts plotter.XYs
		for _, g := range gs {
			if cell, ok := r.cell("pg", c, g); ok && cell.OpsPerSec > 0 {
				pts = append(pts, plotter.XY{X: float64(g), Y: cell.OpsPerSec})
				lo, hi = min(lo, cell.OpsPerSec), max(hi, cell.OpsPerSec)
			}
		}
		if len(pts) == 0 {
			continue
		}
		l, s, err := plotter.NewLinePoints(pts)
		if err != nil {
			return err
		}
		col := chartColors[c]
		l.Color, s.Color = col, col
		l.Width = vg.Points(1.5)
		s.Shape = draw.GlyphDrawer(shapes[i%len(shapes)])
		s.Radius = vg.Points(3)
		if c == "raw" || c == "raw-async" || c == "floor" {
			l.Dashes = []vg.Length{vg.Points(4), vg.Points(3)}
		}
		p.Add(l, s)
		p.Legend.Add(name("pg", c), l, s)
	}
	// Ticks at 1, 2, 5 × powers of ten.
	var yt []plot.Tick
	for d := math.Pow(10, math.Floor(math.Log10(lo))); d <= hi*10; d *= 10 {
		for _, m := range []float64{1, 2, 5} {
			v := d * m
			if v >= lo/1.5 && v <= hi*1.5 {
				yt = append(yt, plot.Tick{Value: v, Label: num(v)})
			}
		}
	}
	p.Y.Tick.Marker = plot.ConstantTicks(yt)
	p.Y.Min, p.Y.Max = lo/1.5, hi*1.5
	p.Legend.Top = true
	p.Legend.Left = true
	p.Legend.TextStyle.Font.Size = vg.Points(8)
	p.Add(plotter.NewGrid())
	return p.Save(9*vg.Inch, 5.5*vg.Inch, path)
}

var shapes = []draw.GlyphDrawer{draw.CircleGlyph{}, draw.SquareGlyph{}, draw.TriangleGlyph{}, draw.PyramidGlyph{}, draw.CrossGlyph{}, draw.PlusGlyph{}, draw.RingGlyph{}, draw.BoxGlyph{}, draw.CircleGlyph{}}
